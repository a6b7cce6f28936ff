#include "distopt/checkpoint/safetensors.hpp"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <span>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "distopt/core/error.hpp"

namespace distopt::checkpoint {

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

std::vector<std::byte> safetensors_head(std::span<const ParamSlot> slots,
                                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::size_t offset = 0;
  for (const ParamSlot& s : slots) {
    header[s.name] = {{"dtype", "F32"}, {"shape", s.shape}, {"data_offsets", {offset, offset + s.numel() * 4}}};
    offset += s.numel() * 4;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the format allows trailing spaces; keeps data 8-aligned
  std::vector<std::byte> out(8 + text.size());
  const std::uint64_t n = text.size();
  std::memcpy(out.data(), &n, 8);
  std::memcpy(out.data() + 8, text.data(), text.size());
  return out;
}

std::vector<std::byte> safetensors_bytes(const NamedTensors& t) {
  for (const ParamSlot& s : t.slots)
    if (s.offset + s.numel() > t.data.size()) throw PreconditionError(str("tensor ", s.name, " lies outside the data"));
  std::vector<std::byte> out = safetensors_head(t.slots, t.metadata);
  for (const ParamSlot& s : t.slots) {
    const auto* at = reinterpret_cast<const std::byte*>(t.data.data() + s.offset);
    out.insert(out.end(), at, at + s.numel() * 4);
  }
  return out;
}

void write_safetensors(const std::string& path, const NamedTensors& t) {
  const std::vector<std::byte> bytes = safetensors_bytes(t);
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw IoError(str(path, ": cannot create ", tmp));
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) {
      std::filesystem::remove(tmp);
      throw IoError(str(path, ": write failed (disk full?)"));
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp);
    throw IoError(str(path, ": cannot replace: ", ec.message()));
  }
}

namespace {

constexpr std::uint64_t kMaxHeader = 100u << 20;  // the format's own limit

// The header of a file whose data region has `data_bytes` bytes, checked
// against it: the tensors' slots index the data region as floats, in the
// file's order (offset = the byte offset / 4).
NamedTensors parse_header(std::string_view text, std::uint64_t data_bytes, const std::string& path) {
  const nlohmann::json header = nlohmann::json::parse(text, nullptr, false);
  if (header.is_discarded() || !header.is_object())
    throw InvalidInput(str(path, ": malformed safetensors header (not a JSON object)"));
  struct Entry {
    std::string name;
    Shape shape;
    std::uint64_t begin, end;
  };
  std::vector<Entry> entries;
  NamedTensors t;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) throw InvalidInput(str(path, ": __metadata__ is not an object"));
      for (const auto& [k, m] : v.items()) {
        if (!m.is_string()) throw InvalidInput(str(path, ": metadata ", k, " is not a string"));
        t.metadata[k] = m.get<std::string>();
      }
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v["dtype"].is_string() || !v.contains("shape") ||
        !v["shape"].is_array() || !v.contains("data_offsets") || !v["data_offsets"].is_array())
      throw InvalidInput(str(path, ": tensor ", name, " lacks dtype, shape or data_offsets"));
    if (v["dtype"] != "F32")
      throw InvalidInput(str(path, ": tensor ", name, " is ", v["dtype"].get<std::string>(), "; distopt reads F32"));
    Entry e{name, {}, 0, 0};
    std::uint64_t elements = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned() || d.get<std::uint64_t>() > data_bytes)
        throw InvalidInput(str(path, ": tensor ", name, " has a dimension that is not a count the file can hold"));
      const std::uint64_t dim = d.get<std::uint64_t>();
      elements = dim == 0 ? 0 : (elements > data_bytes / dim ? data_bytes + 1 : elements * dim);
      e.shape.push_back(static_cast<std::int64_t>(dim));
    }
    const auto& o = v["data_offsets"];
    if (o.size() != 2 || !o[0].is_number_unsigned() || !o[1].is_number_unsigned())
      throw InvalidInput(str(path, ": tensor ", name, " has malformed data_offsets"));
    e.begin = o[0].get<std::uint64_t>();
    e.end = o[1].get<std::uint64_t>();
    if (e.end < e.begin || e.end > data_bytes || e.begin % 4 != 0 || elements > data_bytes / 4 ||
        e.end - e.begin != elements * 4)
      throw InvalidInput(str(path, ": tensor ", name, " has data_offsets that disagree with its shape or the file"));
    entries.push_back(std::move(e));
  }
  // The tensors' bytes tile the data exactly, as the format requires.
  std::vector<const Entry*> order;
  for (const Entry& e : entries) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) { return a->begin < b->begin; });
  std::uint64_t at = 0;
  for (const Entry* e : order) {
    if (e->begin != at) throw InvalidInput(str(path, ": tensor ", e->name, "'s bytes overlap another's or leave a gap"));
    at = e->end;
  }
  if (at != data_bytes) throw InvalidInput(str(path, ": ", data_bytes - at, " bytes after the last tensor"));
  for (const Entry& e : entries) t.slots.push_back({e.name, static_cast<std::size_t>(e.begin / 4), e.shape});
  return t;
}

// The 8-byte header length, checked against the file's size.
std::uint64_t header_length(const std::byte* first8, std::uint64_t file_size, const std::string& path) {
  if (file_size < 8) throw InvalidInput(str(path, ": not a safetensors file (shorter than its 8-byte header length)"));
  std::uint64_t n = 0;
  std::memcpy(&n, first8, 8);
  if (n > file_size - 8 || n > kMaxHeader)
    throw InvalidInput(str(path, ": not a safetensors file (a header of ", n, " bytes in a file of ", file_size, ")"));
  return n;
}

}  // namespace

NamedTensors parse_safetensors(std::span<const std::byte> file, const std::string& path) {
  const std::uint64_t n = header_length(file.data(), file.size(), path);
  const std::string_view text(reinterpret_cast<const char*>(file.data()) + 8, static_cast<std::size_t>(n));
  const std::uint64_t data_bytes = file.size() - 8 - n;
  NamedTensors t = parse_header(text, data_bytes, path);
  t.data.resize(static_cast<std::size_t>(data_bytes / 4));
  if (!t.data.empty()) std::memcpy(t.data.data(), file.data() + 8 + n, t.data.size() * 4);
  return t;
}

namespace {

// The header of the file `in` reads (positioned at its start), checked
// against its `size` bytes; `data_start` is set to where its data begins.
NamedTensors header_of(std::ifstream& in, std::uint64_t size, const std::string& path, std::uint64_t& data_start) {
  std::byte first8[8] = {};
  if (size >= 8 && !in.read(reinterpret_cast<char*>(first8), 8)) throw IoError(str(path, ": read failed"));
  const std::uint64_t n = header_length(first8, size, path);
  std::string text(static_cast<std::size_t>(n), '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(n))) throw IoError(str(path, ": read failed"));
  data_start = 8 + n;
  return parse_header(text, size - data_start, path);
}

std::uint64_t size_of(const std::string& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) throw IoError(str(path, ": cannot stat: ", ec.message()));
  return size;
}

}  // namespace

NamedTensors read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(str(path, ": cannot open"));
  const std::uint64_t size = size_of(path);
  std::uint64_t data_start = 0;
  NamedTensors t = header_of(in, size, path, data_start);  // checked before the data is allocated
  t.data.resize(static_cast<std::size_t>((size - data_start) / 4));
  if (!in.read(reinterpret_cast<char*>(t.data.data()), static_cast<std::streamsize>(t.data.size() * 4)))
    throw IoError(str(path, ": read failed"));
  return t;
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(str(path, ": cannot open"));
  SafetensorsHeader h;
  NamedTensors t = header_of(in, size_of(path), path, h.data_start);
  h.slots = std::move(t.slots);
  h.metadata = std::move(t.metadata);
  return h;
}

}  // namespace distopt::checkpoint
