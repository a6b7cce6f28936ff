#include "distopt/checkpoint/pieces.hpp"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <limits>

#include "distopt/core/error.hpp"

namespace distopt::checkpoint {
namespace {

constexpr const char* kPieceKey = "distopt-piece:";

std::string place_text(std::uint64_t begin, const Shape& shape) {
  std::string s = std::to_string(begin);
  s.push_back(':');
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s.push_back(',');
    s.append(std::to_string(shape[i]));
  }
  return s;
}

}  // namespace

std::uint64_t elements_of(const Shape& shape) {
  std::uint64_t n = 1;
  for (std::int64_t d : shape) {
    if (d < 0) return kMaxElements + 1;
    const auto u = static_cast<std::uint64_t>(d);
    if (u != 0 && n > kMaxElements / u) return kMaxElements + 1;
    n *= u;
  }
  return n;
}

std::map<std::string, Whole> assemble(std::span<const Piece> pieces) {
  std::map<std::string, std::vector<const Piece*>> by_name;
  for (const Piece& p : pieces) by_name[p.name].push_back(&p);
  std::map<std::string, Whole> out;
  for (const auto& [name, list] : by_name) {
    const Shape& shape = list.front()->shape;
    std::uint64_t held = 0;
    for (const Piece* p : list) {
      if (p->shape != shape)
        throw InvalidInput(str("tensor ", name, ": the files disagree on its shape (", to_string(shape), " and ",
                               to_string(p->shape), ")"));
      held += p->values.size();
    }
    const std::uint64_t n = elements_of(shape);
    if (n > kMaxElements) throw InvalidInput(str("tensor ", name, ": shape ", to_string(shape), " is too large"));
    for (const Piece* p : list)
      if (p->begin > n || p->values.size() > n - p->begin)
        throw InvalidInput(str("tensor ", name, ": a piece of ", p->values.size(), " elements at ", p->begin,
                               " lies outside its ", n, " elements"));
    if (held < n)  // before allocating: the pieces cannot cover it
      throw InvalidInput(str("tensor ", name, ": the pieces hold ", held, " of its ", n, " elements"));
    Whole w{shape, std::vector<float>(static_cast<std::size_t>(n))};
    // In order of their first element: each piece extends what is covered,
    // [0, covered); the part it shares with earlier pieces must agree.
    std::vector<const Piece*> sorted = list;
    std::stable_sort(sorted.begin(), sorted.end(), [](const Piece* a, const Piece* b) { return a->begin < b->begin; });
    std::size_t covered = 0;
    for (const Piece* p : sorted) {
      const auto begin = static_cast<std::size_t>(p->begin), end = begin + p->values.size();
      if (p->values.empty()) continue;
      if (begin > covered)
        throw InvalidInput(str("tensor ", name, ": elements [", covered, ", ", begin, ") are in no file (a missing rank?)"));
      const std::size_t shared = std::min(end, covered) - begin;
      if (shared > 0 && std::memcmp(w.values.data() + begin, p->values.data(), shared * sizeof(float)) != 0) {
        std::size_t at = 0;
        while (std::memcmp(&w.values[begin + at], &p->values[at], sizeof(float)) == 0) ++at;
        throw InvalidInput(str("tensor ", name, ": two files hold different values for element ", begin + at, " (",
                               w.values[begin + at], " and ", p->values[at], ")"));
      }
      if (end > covered) {
        std::memcpy(w.values.data() + covered, p->values.data() + (covered - begin), (end - covered) * sizeof(float));
        covered = end;
      }
    }
    if (covered < n)
      throw InvalidInput(str("tensor ", name, ": elements [", covered, ", ", n, ") are in no file (a missing rank?)"));
    out.emplace(name, std::move(w));
  }
  return out;
}

void PieceSet::view(std::string name, Shape shape, std::uint64_t begin, std::span<const float> values) {
  pieces_.push_back({std::move(name), std::move(shape), begin, values});
}

std::span<const float> PieceSet::keep(std::vector<float> values) { return kept_.emplace_back(std::move(values)); }

void PieceSet::add(std::string name, Shape shape, std::uint64_t begin, std::vector<float> values) {
  view(std::move(name), std::move(shape), begin, keep(std::move(values)));
}

void PieceSet::append(PieceSet&& other) {
  // Moving a vector keeps its elements where they are: the views stay valid.
  for (auto& v : other.kept_) kept_.push_back(std::move(v));
  pieces_.insert(pieces_.end(), std::make_move_iterator(other.pieces_.begin()),
                 std::make_move_iterator(other.pieces_.end()));
  other.kept_.clear();
  other.pieces_.clear();
}

std::vector<Piece> PieceSet::copies() const {
  std::vector<Piece> out;
  for (const PieceView& p : pieces_) out.push_back({p.name, p.shape, p.begin, {p.values.begin(), p.values.end()}});
  return out;
}

void write_pieces(const PieceSet& set, const std::function<void(std::span<const std::byte>)>& out) {
  std::map<std::string, std::string> metadata;
  std::vector<ParamSlot> slots;
  for (const PieceView& p : set.pieces()) {
    if (!metadata.emplace(kPieceKey + p.name, place_text(p.begin, p.shape)).second)
      throw PreconditionError(str("two pieces of tensor ", p.name, " in one file"));
    slots.push_back({p.name, 0, {static_cast<std::int64_t>(p.values.size())}});
  }
  out(safetensors_head(slots, metadata));
  for (const PieceView& p : set.pieces()) out(std::as_bytes(p.values));
}

std::vector<std::byte> pieces_bytes(const PieceSet& set) {
  std::vector<std::byte> bytes;
  write_pieces(set, [&](std::span<const std::byte> b) { bytes.insert(bytes.end(), b.begin(), b.end()); });
  return bytes;
}

Place place_of(const std::map<std::string, std::string>& metadata, const ParamSlot& s, const std::string& path) {
  const auto it = metadata.find(kPieceKey + s.name);
  if (it == metadata.end())
    throw InvalidInput(str(path, ": tensor ", s.name, " has no place (no ", kPieceKey, s.name, " metadata)"));
  const std::string& text = it->second;
  Place p;
  const char* c = text.data();
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(c, end, p.begin);
  bool ok = ec == std::errc() && ptr != end && *ptr == ':';
  c = ptr + 1;
  while (ok && c < end) {
    std::int64_t d = 0;
    auto [q, e] = std::from_chars(c, end, d);
    ok = e == std::errc() && d >= 0 && (q == end || *q == ',');
    p.shape.push_back(d);
    c = q == end ? end : q + 1;
    ok = ok && !(q != end && c == end);  // no trailing comma
  }
  if (!ok) throw InvalidInput(str(path, ": tensor ", s.name, " has a malformed place '", text, "'"));
  const std::uint64_t n = elements_of(p.shape);
  if (s.shape.size() != 1 || n > kMaxElements || p.begin > n || s.numel() > n - p.begin)
    throw InvalidInput(str(path, ": tensor ", s.name, "'s piece (", s.numel(), " elements at ", p.begin,
                           ") does not fit its shape ", to_string(p.shape)));
  return p;
}

std::vector<Piece> pieces_of(const NamedTensors& file, const std::string& path) {
  std::vector<Piece> out;
  for (const ParamSlot& s : file.slots) {
    Place place = place_of(file.metadata, s, path);
    out.push_back({s.name, std::move(place.shape), place.begin,
                   std::vector<float>(file.data.begin() + static_cast<std::ptrdiff_t>(s.offset),
                                      file.data.begin() + static_cast<std::ptrdiff_t>(s.offset + s.numel()))});
  }
  return out;
}

}  // namespace distopt::checkpoint
