// The crash-safe checkpoint store (include/distopt/checkpoint/store.hpp):
// complete-or-ignored directories, verification of every file, the newest
// complete checkpoint, pruning.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/run.hpp"
#include "distopt/checkpoint/run_state.hpp"
#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/checkpoint/source.hpp"
#include "distopt/checkpoint/store.hpp"
#include "distopt/checkpoint/survival.hpp"
#include "distopt/core/error.hpp"

using namespace distopt;
using namespace distopt::checkpoint;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string t = (fs::temp_directory_path() / "distopt-ckpt-XXXXXX").string();
    path = ::mkdtemp(t.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> b(s.size());
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}

// A checkpoint at `step` of two rank files, complete.
fs::path write_checkpoint(const fs::path& root, std::uint64_t step) {
  const fs::path dir = checkpoint_dir(root, step);
  fs::create_directories(dir);
  Manifest m;
  m.step = step;
  m.body = R"({"model": "mlp", "world": 2})";
  m.files.push_back(write_file(dir, "rank0.safetensors", bytes_of("rank zero's tensors " + std::to_string(step))));
  m.files.push_back(write_file(dir, "rank1.safetensors", bytes_of("rank one's tensors " + std::to_string(step))));
  write_manifest(dir, m);
  return dir;
}

// The one-line InvalidInput message of f(), or "" when it succeeds.
template <class F>
std::string one_line_error(F&& f) {
  try {
    f();
  } catch (const InvalidInput& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    return m;
  }
  return "";
}

std::string error_of(const fs::path& dir) {
  return one_line_error([&] { (void)verify(dir); });
}

}  // namespace

TEST(CheckpointStore, AWrittenCheckpointVerifiesAndCarriesItsBody) {
  TempDir t;
  const fs::path dir = write_checkpoint(t.path, 7);
  EXPECT_EQ(dir.filename(), "step-000000000007");
  const Manifest m = verify(dir);
  EXPECT_EQ(m.step, 7u);
  ASSERT_EQ(m.files.size(), 2u);
  EXPECT_EQ(m.files[1].name, "rank1.safetensors");
  EXPECT_EQ(m.files[1].xxh64, xxh64_of_file(dir / "rank1.safetensors"));
  EXPECT_NE(m.body.find("\"world\":2"), std::string::npos) << m.body;
  // No temporary file is left behind.
  for (const auto& e : fs::directory_iterator(dir)) EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos);
}

TEST(CheckpointStore, DamageIsOneLineNamingTheFile) {
  TempDir t;
  const fs::path dir = write_checkpoint(t.path, 3);
  const fs::path f = dir / "rank1.safetensors";
  const std::uintmax_t n = fs::file_size(f);
  // A flipped byte: the checksum.
  {
    std::fstream io(f, std::ios::binary | std::ios::in | std::ios::out);
    io.seekp(5);
    io.put('X');
  }
  std::string e = error_of(dir);
  EXPECT_NE(e.find("rank1.safetensors is corrupted: its xxh64 is"), std::string::npos) << e;
  // Truncated.
  fs::resize_file(f, n - 4);
  e = error_of(dir);
  EXPECT_NE(e.find("rank1.safetensors has " + std::to_string(n - 4) + " bytes, the manifest says " +
                   std::to_string(n) + " (truncated)"),
            std::string::npos)
      << e;
  // Missing.
  fs::remove(f);
  EXPECT_NE(error_of(dir).find("rank1.safetensors is missing"), std::string::npos);
  // A newer format version.
  const fs::path other = write_checkpoint(t.path, 4);
  {
    std::ifstream in(other / "manifest.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto at = text.find("\"version\": 1");
    ASSERT_NE(at, std::string::npos) << text;
    text.replace(at, 12, "\"version\": 2");
    std::ofstream(other / "manifest.json", std::ios::trunc) << text;
  }
  e = error_of(other);
  EXPECT_NE(e.find("is of format version 2; this distopt reads version 1 (a newer distopt wrote it)"), std::string::npos)
      << e;
  // Not a manifest at all, and none.
  std::ofstream(other / "manifest.json", std::ios::trunc) << "[1, 2]";
  EXPECT_NE(error_of(other).find("manifest.json is not a JSON object"), std::string::npos);
  fs::remove(other / "manifest.json");
  EXPECT_NE(error_of(other).find("manifest.json is missing"), std::string::npos);
  // A manifest that names a file outside the directory.
  const fs::path third = write_checkpoint(t.path, 5);
  {
    std::ifstream in(third / "manifest.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto at = text.find("rank0.safetensors");
    text.replace(at, 17, "../../etc/passwd0");
    std::ofstream(third / "manifest.json", std::ios::trunc) << text;
  }
  EXPECT_NE(error_of(third).find("bad file entry '../../etc/passwd0'"), std::string::npos);
}

TEST(CheckpointStore, AWriterKilledMidwayLeavesThePreviousCheckpointTheLatest) {
  TempDir t;
  write_checkpoint(t.path, 10);
  // A child writes the next checkpoint's first file and dies before the
  // manifest, as a killed run would.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const fs::path dir = checkpoint_dir(t.path, 20);
    fs::create_directories(dir);
    (void)write_file(dir, "rank0.safetensors", bytes_of("half a checkpoint"));
    ::_exit(9);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 9);
  ASSERT_TRUE(fs::exists(checkpoint_dir(t.path, 20) / "rank0.safetensors"));
  const auto latest = latest_complete(t.path);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(*latest, checkpoint_dir(t.path, 10));
  EXPECT_EQ(verify(*latest).step, 10u);
  // Nothing at all, and a root that does not exist.
  TempDir empty;
  EXPECT_FALSE(latest_complete(empty.path).has_value());
  EXPECT_FALSE(latest_complete(empty.path / "none").has_value());
}

TEST(CheckpointStore, PruneKeepsTheNewestCompleteOnesAndAWriteInProgress) {
  TempDir t;
  for (std::uint64_t s : {100, 200, 300, 400}) write_checkpoint(t.path, s);
  fs::create_directories(checkpoint_dir(t.path, 250));  // interrupted, older than the newest: dead
  fs::create_directories(checkpoint_dir(t.path, 500));  // newer than the newest: maybe being written
  fs::create_directories(t.path / "notes");              // not a checkpoint: left alone
  const auto removed = prune(t.path, 2);
  EXPECT_EQ(removed.size(), 3u);
  for (std::uint64_t s : {100, 200, 250}) EXPECT_FALSE(fs::exists(checkpoint_dir(t.path, s))) << s;
  for (std::uint64_t s : {300, 400, 500}) EXPECT_TRUE(fs::exists(checkpoint_dir(t.path, s))) << s;
  EXPECT_TRUE(fs::exists(t.path / "notes"));
  EXPECT_EQ(*latest_complete(t.path), checkpoint_dir(t.path, 400));
  EXPECT_NO_THROW((void)verify(checkpoint_dir(t.path, 300)));
}

TEST(CheckpointStore, PruneAfterAWriteRemovesEveryLaterCheckpoint) {
  // A run writing step 12 into a directory holding another run's steps 10
  // and 16: the 16 goes (else it would be the newest, what --resume and
  // survivors go back to), the 10 is kept as an older one.
  TempDir t;
  for (std::uint64_t s : {5, 10, 12, 16}) write_checkpoint(t.path, s);
  fs::create_directories(checkpoint_dir(t.path, 20));  // an interrupted write of a later step too
  const auto removed = prune(t.path, 3, 12);
  EXPECT_EQ(removed.size(), 2u);
  for (std::uint64_t s : {16, 20}) EXPECT_FALSE(fs::exists(checkpoint_dir(t.path, s))) << s;
  for (std::uint64_t s : {5, 10, 12}) EXPECT_TRUE(fs::exists(checkpoint_dir(t.path, s))) << s;
  EXPECT_EQ(*latest_complete(t.path), checkpoint_dir(t.path, 12));
}

namespace {

// A safetensors file of the given header text and data bytes.
std::vector<std::byte> safetensors_bytes(const std::string& header, std::size_t data_bytes) {
  std::vector<std::byte> f(8 + header.size() + data_bytes, std::byte{0});
  const std::uint64_t n = header.size();
  std::memcpy(f.data(), &n, 8);
  std::memcpy(f.data() + 8, header.data(), header.size());
  return f;
}

std::string parse_error(const std::vector<std::byte>& f) {
  const std::string m = one_line_error([&] { (void)parse_safetensors(f, "x.safetensors"); });
  if (!m.empty()) {
    EXPECT_EQ(m.rfind("x.safetensors: ", 0), 0u) << m;
  }
  return m;
}

}  // namespace

// A run's state as bytes (what a rank that joins a gloo run receives):
// round trip, an empty tensor (state_bytes_fuzz found memcpy given a null
// destination for it), and malformed bytes as one line.
TEST(StateBytes, RoundTripEmptyTensorsAndMalformedBytes) {
  checkpoint::Loaded a;
  a.step = 7;
  a.config = R"({"world": 3})";
  a.state = R"({"groups": []})";
  a.wholes["param.w"] = checkpoint::Whole{{2, 2}, {1, 2, 3, 4}};
  a.wholes["param.empty"] = checkpoint::Whole{{0, 4}, {}};
  a.wholes["state.0.step"] = checkpoint::Whole{{}, {5}};
  const std::vector<char> bytes = checkpoint::to_bytes(a);
  const checkpoint::Loaded b = checkpoint::from_bytes(bytes);
  EXPECT_EQ(b.step, 7u);
  EXPECT_EQ(b.config, a.config);
  EXPECT_EQ(b.state, a.state);
  ASSERT_EQ(b.wholes.size(), 3u);
  EXPECT_EQ(b.wholes.at("param.w").values, (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(b.wholes.at("param.empty").shape, (Shape{0, 4}));
  EXPECT_TRUE(b.wholes.at("param.empty").values.empty());
  EXPECT_EQ(checkpoint::to_bytes(b), bytes);
  const auto message = [](std::vector<char> v) {
    try {
      checkpoint::from_bytes(v);
    } catch (const InvalidInput& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  std::vector<char> cut(bytes.begin(), bytes.end() - 3);
  EXPECT_NE(message(cut).find("runs past the end of the bytes"), std::string::npos) << message(cut);
  std::vector<char> more = bytes;
  more.push_back(0);
  EXPECT_NE(message(more).find("bytes after its last tensor"), std::string::npos);
  // Regression (found by state_bytes_fuzz): a dimension of 2^63 beside a 0
  // left the element count 0 and came back as a negative extent, which
  // to_bytes then tried to allocate for.
  checkpoint::Loaded c;
  c.wholes["t"] = checkpoint::Whole{{0, 5}, {}};
  std::vector<char> huge = checkpoint::to_bytes(c);
  const char five[8] = {5, 0, 0, 0, 0, 0, 0, 0};
  const auto at = std::search(huge.begin(), huge.end(), five, five + 8);
  ASSERT_NE(at, huge.end());
  at[7] = static_cast<char>(0x80);  // 2^63 + 5
  EXPECT_NE(message(huge).find("tensor t has a dimension of 9223372036854775813"), std::string::npos) << message(huge);
}

TEST(Safetensors, RoundTripAndEveryMalformedHeaderIsOneLine) {
  TempDir t;
  NamedTensors in;
  in.slots = {{"a", 0, {2, 3}}, {"b", 6, {}}, {"empty", 7, {0, 4}}};
  in.data = {1, 2, 3, 4, 5, 6, 7};
  in.metadata["piece:a"] = "0";
  const std::string path = (t.path / "t.safetensors").string();
  write_safetensors(path, in);
  const NamedTensors out = read_safetensors(path);
  ASSERT_EQ(out.slots.size(), 3u);
  EXPECT_EQ(out.slots[0].shape, (Shape{2, 3}));
  EXPECT_EQ(out.data, in.data);
  EXPECT_EQ(out.metadata.at("piece:a"), "0");

  const std::string ok = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  EXPECT_EQ(parse_error(safetensors_bytes(ok, 8)), "");
  EXPECT_NE(parse_error(std::vector<std::byte>(5)).find("shorter than its 8-byte header length"), std::string::npos);
  auto f = safetensors_bytes(ok, 8);
  const std::uint64_t huge = ~std::uint64_t{0} - 3;
  std::memcpy(f.data(), &huge, 8);
  EXPECT_NE(parse_error(f).find("not a safetensors file (a header of"), std::string::npos);
  EXPECT_NE(parse_error(safetensors_bytes("[1]", 0)).find("not a JSON object"), std::string::npos);
  EXPECT_NE(parse_error(safetensors_bytes("{\"a\": {", 0)).find("not a JSON object"), std::string::npos);
  EXPECT_NE(parse_error(safetensors_bytes(R"({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}})", 4))
                .find("tensor a is F16; distopt reads F32"),
            std::string::npos);
  EXPECT_NE(parse_error(safetensors_bytes(R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8))
                .find("not a count"),
            std::string::npos);
  EXPECT_NE(parse_error(safetensors_bytes(R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}})", 8))
                .find("not a count the file can hold"),
            std::string::npos);
  EXPECT_NE(parse_error(safetensors_bytes(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8))
                .find("disagree with its shape or the file"),
            std::string::npos);
  EXPECT_NE(parse_error(safetensors_bytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})", 12))
                .find("overlap another's or leave a gap"),
            std::string::npos);
  EXPECT_NE(parse_error(safetensors_bytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                             "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8))
                .find("overlap another's or leave a gap"),
            std::string::npos);
  EXPECT_NE(parse_error(safetensors_bytes(ok, 12)).find("4 bytes after the last tensor"), std::string::npos);
  EXPECT_NE(parse_error(safetensors_bytes(R"({"__metadata__": {"k": 1}})", 0)).find("metadata k is not a string"),
            std::string::npos);
  EXPECT_NE(parse_error(safetensors_bytes(R"({"a": {"shape": [2], "data_offsets": [0, 8]}})", 8)).find("lacks dtype"),
            std::string::npos);
}

namespace {

std::string assemble_error(const std::vector<checkpoint::Piece>& pieces) {
  return one_line_error([&] { (void)assemble(pieces); });
}

// The file a rank would write of these pieces, read back.
NamedTensors file_of(const std::vector<checkpoint::Piece>& pieces) {
  checkpoint::PieceSet set;
  for (const checkpoint::Piece& p : pieces) set.view(p.name, p.shape, p.begin, p.values);
  return parse_safetensors(pieces_bytes(set), "rank.safetensors");
}

// Files of pieces in `dir`, one per list: their paths.
std::vector<std::string> files_of(const fs::path& dir, const std::vector<std::vector<checkpoint::Piece>>& files) {
  std::vector<std::string> paths;
  for (const auto& pieces : files) {
    checkpoint::PieceSet set;
    for (const checkpoint::Piece& p : pieces) set.view(p.name, p.shape, p.begin, p.values);
    paths.push_back((dir / str("rank", paths.size(), ".safetensors")).string());
    const std::vector<std::byte> bytes = pieces_bytes(set);
    std::ofstream out(paths.back(), std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  return paths;
}

}  // namespace

TEST(CheckpointStore, AFileWrittenPieceByPieceIsTheFileWrittenAtOnce) {
  // Small writes gathered and large ones passed straight through give the
  // same file, size and checksum as one write of the whole.
  TempDir t;
  std::vector<std::byte> whole;
  for (std::size_t n : {std::size_t{3}, std::size_t{1} << 20, std::size_t{5}, std::size_t{3} << 19, std::size_t{0}, std::size_t{7}})
    for (std::size_t i = 0; i < n; ++i) whole.push_back(static_cast<std::byte>((i * 131 + n) & 0xff));
  const FileEntry at_once = write_file(t.path, "a", whole);
  FileEntry in_pieces;
  {
    FileWriter w(t.path, "b");
    std::size_t at = 0;
    for (std::size_t n : {std::size_t{3}, std::size_t{1} << 20, std::size_t{5}, std::size_t{3} << 19, std::size_t{0}, std::size_t{7}}) {
      w.write(std::span(whole).subspan(at, n));
      at += n;
    }
    in_pieces = w.commit();
  }
  EXPECT_EQ(in_pieces.bytes, at_once.bytes);
  EXPECT_EQ(in_pieces.xxh64, at_once.xxh64);
  EXPECT_EQ(in_pieces.xxh64, xxh64_of_file(t.path / "b"));
  EXPECT_EQ(xxh64_of_file(t.path / "a"), xxh64_of_file(t.path / "b"));
  // A writer given up before its commit leaves no file, temporary or final.
  {
    FileWriter w(t.path, "c");
    w.write(std::span(whole).first(10));
  }
  std::size_t files = 0;
  for (const auto& e : fs::directory_iterator(t.path)) files += e.path().filename() != "a" && e.path().filename() != "b";
  EXPECT_EQ(files, 0u);
  EXPECT_FALSE(fs::exists(t.path / "c"));
}

TEST(Pieces, AnyCutReassemblesBitForBitThroughTheirFiles) {
  // A 5 x 7 tensor and a scalar, cut at every world size 1-8 into
  // contiguous pieces (empty ones included), written and read back as
  // safetensors, and assembled; a replicated copy (ddp) changes nothing.
  std::vector<float> w(35);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.1f * float(i) - 1.0f;
  for (int world = 1; world <= 8; ++world) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<checkpoint::Piece> all;
    for (int r = 0; r < world; ++r) {
      const std::size_t begin = w.size() * r / world, end = w.size() * (r + 1) / world;
      std::vector<checkpoint::Piece> mine = {{"fc.weight", {5, 7}, begin, {w.begin() + begin, w.begin() + end}}};
      if (r == world - 1) mine.push_back({"scale", {}, 0, {2.5f}});
      const NamedTensors file = file_of(mine);
      const auto back = pieces_of(file, "rank.safetensors");
      all.insert(all.end(), back.begin(), back.end());
    }
    all.push_back({"fc.weight", {5, 7}, 0, w});  // a replicated copy
    const auto whole = assemble(all);
    ASSERT_EQ(whole.size(), 2u);
    EXPECT_EQ(whole.at("fc.weight").shape, (Shape{5, 7}));
    EXPECT_EQ(whole.at("fc.weight").values, w);
    EXPECT_EQ(whole.at("scale").values, std::vector<float>{2.5f});
  }
}

TEST(Pieces, GapsDisagreementsAndBadPlacesAreOneLineNamingTheTensor) {
  const std::vector<float> v = {1, 2, 3, 4, 5, 6};
  // Enough elements (a duplicate), but a gap.
  EXPECT_NE(assemble_error({{"t", {6}, 0, {1, 2}}, {"t", {6}, 4, {5, 6}}, {"t", {6}, 0, {1, 2}}})
                .find("tensor t: elements [2, 4) are in no file (a missing rank?)"),
            std::string::npos);
  EXPECT_NE(assemble_error({{"t", {6}, 0, {1, 2, 3}}, {"t", {6}, 3, {4, 5}}}).find("the pieces hold 5 of its 6 elements"),
            std::string::npos);
  EXPECT_NE(assemble_error({{"t", {6}, 0, v}, {"t", {6}, 2, {3, 9}}}).find("two files hold different values for element 3"),
            std::string::npos);
  EXPECT_NE(assemble_error({{"t", {6}, 0, v}, {"t", {2, 3}, 0, v}}).find("the files disagree on its shape ([6] and [2, 3])"),
            std::string::npos);
  EXPECT_NE(assemble_error({{"t", {6}, 5, {1, 2}}, {"t", {6}, 0, v}}).find("lies outside its 6 elements"),
            std::string::npos);
  EXPECT_NE(assemble_error({{"t", {1 << 30, 1 << 30, 1 << 30}, 0, {1}}}).find("is too large"), std::string::npos);
  // Places in a file.
  NamedTensors f = file_of({{"t", {6}, 2, {3, 4}}});
  auto place_error = [&](const std::string& place) -> std::string {
    NamedTensors g = f;
    if (place.empty()) g.metadata.clear();
    else g.metadata["distopt-piece:t"] = place;
    return one_line_error([&] { (void)pieces_of(g, "rank3.safetensors"); });
  };
  EXPECT_EQ(place_error("2:6"), "");
  EXPECT_NE(place_error("").find("rank3.safetensors: tensor t has no place"), std::string::npos);
  for (const char* bad : {"2", "x:6", "2:6,", "2:-6", "2:6,,1", ":6"})
    EXPECT_NE(place_error(bad).find("rank3.safetensors: tensor t has a malformed place"), std::string::npos) << bad;
  EXPECT_NE(place_error("5:6").find("does not fit its shape [6]"), std::string::npos);
  EXPECT_NE(place_error("0:4294967296,4294967296,4294967296").find("does not fit its shape"), std::string::npos);
}

TEST(PieceFiles, EveryRangeReadFromTheFilesIsTheWholeTensorsBits) {
  // A 5 x 7 tensor cut at world sizes 1-8 into contiguous pieces (empty
  // ones included) plus a replicated copy, and a scalar every rank holds:
  // every range [b, e) read from the files is the tensor's, and reading
  // the scalar compares its copies.
  TempDir t;
  std::vector<float> w(35);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.1f * float(i) - 1.0f;
  for (int world = 1; world <= 8; ++world) {
    SCOPED_TRACE("world " + std::to_string(world));
    std::vector<std::vector<checkpoint::Piece>> files;
    for (int r = 0; r < world; ++r) {
      const std::size_t begin = w.size() * r / world, end = w.size() * (r + 1) / world;
      files.push_back({{"fc.weight", {5, 7}, begin, {w.begin() + begin, w.begin() + end}}, {"step", {}, 0, {3.0f}}});
    }
    if (world == 3) files.push_back({{"fc.weight", {5, 7}, 0, w}});  // ddp's replica
    const fs::path dir = t.path / std::to_string(world);
    fs::create_directories(dir);
    const PieceFiles source(files_of(dir, files));
    EXPECT_EQ(source.names(), (std::vector<std::string>{"fc.weight", "step"}));
    ASSERT_NE(source.shape("fc.weight"), nullptr);
    EXPECT_EQ(*source.shape("fc.weight"), (Shape{5, 7}));
    EXPECT_EQ(source.shape("fc.bias"), nullptr);
    EXPECT_EQ(source.whole("step"), std::vector<float>{3.0f});
    for (std::size_t b = 0; b <= w.size(); ++b)
      for (std::size_t e = b; e <= w.size(); ++e) {
        std::vector<float> got(e - b, -7.0f);
        source.read("fc.weight", b, got);
        ASSERT_EQ(got, std::vector<float>(w.begin() + b, w.begin() + e)) << b << " " << e;
      }
    std::vector<float> past(6);
    EXPECT_THROW(source.read("fc.weight", 30, past), PreconditionError);
  }
}

TEST(PieceFiles, GapsDisagreementsAndShapesAreOneLineNamingTheTensor) {
  TempDir t;
  const std::vector<float> v = {1, 2, 3, 4, 5, 6};
  auto made = [&](const std::vector<std::vector<checkpoint::Piece>>& files) {
    static int n = 0;
    const fs::path dir = t.path / std::to_string(n++);
    fs::create_directories(dir);
    return files_of(dir, files);
  };
  auto error_making = [&](const std::vector<std::vector<checkpoint::Piece>>& files) {
    const auto paths = made(files);
    return one_line_error([&] { PieceFiles source(paths); });
  };
  // Found from the headers, before any value is read.
  EXPECT_NE(error_making({{{"t", {6}, 0, {1, 2}}}, {{"t", {6}, 4, {5, 6}}}})
                .find("tensor t: elements [2, 4) are in no file (a missing rank?)"),
            std::string::npos);
  EXPECT_NE(error_making({{{"t", {6}, 0, {1, 2, 3}}}, {{"t", {6}, 3, {4, 5}}}})
                .find("tensor t: elements [5, 6) are in no file"),
            std::string::npos);
  EXPECT_NE(error_making({{{"t", {6}, 0, v}}, {{"t", {2, 3}, 0, v}}})
                .find("the files disagree on its shape ([6] and [2, 3])"),
            std::string::npos);
  // Two copies that differ: an error for a read that sees both, none for one that does not.
  const PieceFiles source(made({{{"t", {6}, 0, v}}, {{"t", {6}, 2, {3, 9}}}}));
  std::vector<float> two(2);
  EXPECT_NE(
      one_line_error([&] { source.read("t", 2, two); }).find("tensor t: two files hold different values for element 3"),
      std::string::npos);
  source.read("t", 0, two);
  EXPECT_EQ(two, (std::vector<float>{1, 2}));
  // A file that is not one.
  const fs::path junk = t.path / "junk.safetensors";
  std::ofstream(junk) << "not a safetensors file";
  EXPECT_NE(one_line_error([&] { PieceFiles f({junk.string()}); }).find("junk.safetensors: not a safetensors file"),
            std::string::npos);
  EXPECT_THROW(PieceFiles({(t.path / "absent.safetensors").string()}), IoError);
}

// Regression (found by safetensors_fuzz): a file entry that lacks a key
// ("xxhv4" for "xxh64") made parse_manifest index a const JSON object with
// operator[] on the missing key -- undefined behaviour, a heap-use-after-free
// under AddressSanitizer. Every missing or mistyped member is one line.
TEST(CheckpointStore, AFileEntryLackingAKeyIsOneLine) {
  const std::string head = R"({"format": "distopt-checkpoint", "version": 1, "step": 4, "files": [)";
  for (const char* entry : {R"({"name": "rank0.safetensors", "bytes": 12, "xxhv4": "0123456789abcdef"})",
                            R"({"name": "rank0.safetensors", "xxh64": "0123456789abcdef"})",
                            R"({"bytes": 12, "xxh64": "0123456789abcdef"})", R"({"name": 5, "bytes": 12, "xxh64": ""})",
                            R"(["rank0.safetensors", 12])", R"(7)"}) {
    const std::string e = one_line_error([&] { (void)parse_manifest(head + entry + "]}", "ck: "); });
    EXPECT_NE(e.find("a file entry lacks name, bytes or xxh64"), std::string::npos) << entry << ": " << e;
  }
  EXPECT_NO_THROW((void)parse_manifest(
      head + R"({"name": "rank0.safetensors", "bytes": 12, "xxh64": "0123456789abcdef"}]})", "ck: "));
}

// The run state --resume reads: every member missing, of the wrong type or
// nested too deep is one line, never undefined behaviour.
TEST(RunState, MissingAndMistypedMembersAreOneLine) {
  const std::pair<const char*, const char*> cases[] = {
      {R"([1, 2])", "is not a JSON object"},
      {R"({"groups": 3})", "groups is not a list"},
      {R"({"groups": [{"options": {}}]})", "lacks options or extras"},
      {R"({"groups": [{"options": {"lr": [1, 2, 3]}, "extras": {}}]})", "neither a number nor a pair"},
      {R"({"groups": [{"options": {"lr": "fast"}, "extras": {}}]})", "lr is not a number"},
      {R"({"scheduler": {"kind": "steplr", "values": {}}})", "a malformed scheduler state"},
      {R"({"scheduler": {"values": {}, "children": []}})", "a malformed scheduler state"},
      {R"({"scheduler": {"kind": "x", "values": {"last_epoch": 3}, "children": []}})", "is not a list"},
      {R"({"scaler": {"scale": 1, "growth_interval": 2}})", "a malformed loss-scaler state"},
      {R"({"scaler": {"growth_interval": 2, "growth_tracker": 0}})", "scale is not a number"},
      {R"({"averaged": {}})", "a malformed averaging state"},
      {R"({"averaged": 5})", "a malformed averaging state"},
      {R"({"gossip": {"strategy": "sgp"}})", "a malformed gossip state"},
      {R"({"gossip": {"ranks": []}})", "a malformed gossip state"},
      {R"({"gossip": {"strategy": "sgp", "ranks": [{"steps": 3}]}})", "no gossip state for rank 0"},
      {R"({"gossip": {"strategy": "sgp", "ranks": [{"steps": 3, "numbers": []}, {"numbers": []}]}})",
       "no gossip state for rank 1"},
  };
  for (const auto& [text, expected] : cases) {
    const std::string e = one_line_error([&] { (void)parse_run_state(text); });
    EXPECT_NE(e.find(expected), std::string::npos) << text << ": " << e;
  }
  std::string deep = R"({"kind": "a", "values": {}, "children": []})";
  for (int i = 0; i < 100; ++i) deep = R"({"kind": "a", "values": {}, "children": [)" + deep + "]}";
  const std::string e = one_line_error([&] { (void)parse_run_state(R"({"scheduler": )" + deep + "}"); });
  EXPECT_NE(e.find("nested deeper"), std::string::npos) << e;
}

TEST(RunState, WrittenAndReadBackItIsTheSame) {
  RunState s;
  s.groups.emplace();
  s.groups->push_back({{{"lr", OptionValue(0.25)}, {"betas", OptionValue(0.9, 0.999)}}, {{"initial_lr", 0.5}}});
  s.scheduler = SchedulerState{"sequentiallr", {{"last_epoch", {3}}}, {SchedulerState{"linearlr", {{"x", {1, 2}}}, {}}}};
  s.scaler = GradScalerState{65536.0, 2.0, 0.5, 2000, 7};
  s.n_averaged = 4;
  s.gossip = RunState::Gossip{"osgp", 3, parallel::GossipOptions{}, {{5, {1.0, 0.5}}, {5, {}}, {6, {2.0}}}};
  s.gossip->options->synch_freq = 2;
  const RunState r = parse_run_state(run_state_json(s));
  ASSERT_TRUE(r.groups && r.groups->size() == 1);
  EXPECT_EQ((*r.groups)[0].options.at("betas"), OptionValue(0.9, 0.999));
  EXPECT_EQ((*r.groups)[0].options.at("lr"), OptionValue(0.25));
  EXPECT_EQ((*r.groups)[0].extras.at("initial_lr"), 0.5);
  ASSERT_TRUE(r.scheduler && r.scheduler->children.size() == 1);
  EXPECT_EQ(r.scheduler->children[0].values.at("x"), (std::vector<double>{1, 2}));
  ASSERT_TRUE(r.scaler);
  EXPECT_EQ(r.scaler->growth_tracker, 7);
  EXPECT_EQ(r.n_averaged, 4);
  ASSERT_TRUE(r.gossip && r.gossip->options);
  EXPECT_EQ(r.gossip->world, 3);
  EXPECT_EQ(r.gossip->options->synch_freq, 2);
  EXPECT_EQ(r.gossip->options->topology, "");
  ASSERT_EQ(r.gossip->ranks.size(), 3u);
  EXPECT_EQ(r.gossip->ranks[2].steps, 6u);
  EXPECT_EQ(r.gossip->ranks[0].numbers, (std::vector<double>{1.0, 0.5}));
  EXPECT_FALSE(r.swa_scheduler);
}
