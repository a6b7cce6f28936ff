#include "distopt/checkpoint/safetensors.hpp"

#include <unistd.h>

#include <bit>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "distopt/core/error.hpp"

namespace distopt::checkpoint {

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

void write_safetensors(const std::string& path, const NamedTensors& t) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!t.metadata.empty()) header["__metadata__"] = t.metadata;
  std::size_t offset = 0;
  for (const ParamSlot& s : t.slots) {
    if (s.offset + s.numel() > t.data.size()) throw PreconditionError(str("tensor ", s.name, " lies outside the data"));
    header[s.name] = {{"dtype", "F32"}, {"shape", s.shape}, {"data_offsets", {offset, offset + s.numel() * 4}}};
    offset += s.numel() * 4;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the format allows trailing spaces; keeps data 8-aligned
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw IoError(str(path, ": cannot create ", tmp));
    const std::uint64_t n = text.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    for (const ParamSlot& s : t.slots)
      out.write(reinterpret_cast<const char*>(t.data.data() + s.offset), static_cast<std::streamsize>(s.numel() * 4));
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

NamedTensors read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(str(path, ": cannot open"));
  const auto file_size = std::filesystem::file_size(path);
  std::uint64_t n = 0;
  if (!in.read(reinterpret_cast<char*>(&n), 8) || n > file_size - 8)
    throw InvalidInput(str(path, ": not a safetensors file (bad header length)"));
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InvalidInput(str(path, ": malformed safetensors header: ", e.what()));
  }
  const std::uint64_t data_bytes = file_size - 8 - n;
  std::vector<char> bytes(data_bytes);
  in.read(bytes.data(), static_cast<std::streamsize>(data_bytes));
  NamedTensors t;
  std::size_t elements = 0;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      for (auto& [k, m] : v.items()) t.metadata[k] = m.get<std::string>();
      continue;
    }
    if (!v.is_object() || v.value("dtype", "") != "F32")
      throw InvalidInput(str(path, ": tensor ", name, " is not F32"));
    const auto offsets = v.at("data_offsets").get<std::vector<std::uint64_t>>();
    Shape shape = v.at("shape").get<Shape>();
    if (offsets.size() != 2 || offsets[1] < offsets[0] || offsets[1] > data_bytes ||
        offsets[1] - offsets[0] != static_cast<std::uint64_t>(numel(shape)) * 4 || offsets[0] % 4 != 0)
      throw InvalidInput(str(path, ": tensor ", name, " has data_offsets that disagree with its shape or the file"));
    t.slots.push_back({name, elements, shape});
    t.data.resize(elements + numel(shape));
    std::memcpy(t.data.data() + elements, bytes.data() + offsets[0], offsets[1] - offsets[0]);
    elements += numel(shape);
  }
  return t;
}

}  // namespace distopt::checkpoint
