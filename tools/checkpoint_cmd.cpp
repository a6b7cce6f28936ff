// distopt checkpoint export|inspect: a checkpoint directory's whole tensors
// as one safetensors file, and what a checkpoint holds (docs/formats.md).
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.hpp"
#include "distopt/checkpoint/pieces.hpp"
#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/checkpoint/state.hpp"
#include "distopt/checkpoint/store.hpp"
#include "distopt/optim/quant.hpp"
#include "distopt/train/trainer.hpp"

namespace distopt::cli {
namespace {

namespace fs = std::filesystem;

struct CheckpointArgs {
  std::string dir, output;
  bool optimizer_state = false, dequantize = false, json = false;
};

// DIR itself when it holds a manifest, else the latest complete
// checkpoint under it.
fs::path checkpoint_of(const std::string& dir) {
  std::error_code ec;
  if (fs::is_regular_file(fs::path(dir) / "manifest.json", ec)) return dir;
  if (!fs::is_directory(dir, ec)) throw InvalidInput(str(dir, ": no such checkpoint directory"));
  const auto latest = checkpoint::latest_complete(dir);
  if (!latest) throw InvalidInput(str(dir, ": no complete checkpoint in it"));
  return *latest;
}

struct Loaded {
  fs::path dir;
  checkpoint::Manifest manifest;
  nlohmann::json body;
  std::map<std::string, checkpoint::Whole> wholes;
};

Loaded load(const std::string& dir) {
  Loaded l;
  l.dir = checkpoint_of(dir);
  l.manifest = checkpoint::verify(l.dir);
  l.body = nlohmann::json::parse(l.manifest.body, nullptr, false);
  if (!l.body.is_object()) l.body = nlohmann::json::object();
  l.wholes = checkpoint::read_wholes(l.dir, l.manifest);
  return l;
}

std::string text_of(const nlohmann::json& body, const char* key) {
  if (!body.contains(key)) return "?";
  return body[key].is_string() ? body[key].get<std::string>() : body[key].dump();
}

// The block scales of quantized optimizer state ("state.3.exp_avg.absmax",
// beside "state.3.exp_avg": docs/optimizers.md, "Quantized state").
bool is_scales(const std::string& name) {
  const std::string_view suffix = quant::kAbsmaxSuffix;
  return name.rfind("state.", 0) == 0 && name.size() > suffix.size() &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

int run_export(const CheckpointArgs& a) {
  if (a.dequantize && !a.optimizer_state) throw InvalidInput("--dequantize applies to --optimizer-state");
  const Loaded l = load(a.dir);
  checkpoint::NamedTensors out;
  std::vector<float> params;  // slot order, as param_hash takes them
  for (const auto& [name, whole] : l.wholes) {
    const bool param = name.rfind("param.", 0) == 0;
    if (!param && !(a.optimizer_state && name.rfind("state.", 0) == 0)) continue;
    if (a.dequantize && is_scales(name)) continue;  // the values are the dequantized state already
    out.slots.push_back({param ? name.substr(6) : name, out.data.size(), whole.shape});
    out.data.insert(out.data.end(), whole.values.begin(), whole.values.end());
  }
  // The model's order (the manifest's config names the model; the pieces
  // are sorted by name): param_hash over the parameters as training saw them.
  const std::vector<std::string> order = l.body.contains("param_order") && l.body["param_order"].is_array()
                                             ? l.body["param_order"].get<std::vector<std::string>>()
                                             : std::vector<std::string>{};
  for (const std::string& name : order) {
    const auto it = l.wholes.find("param." + name);
    if (it == l.wholes.end()) throw InvalidInput(str(l.dir.string(), ": the checkpoint lacks parameter ", name));
    params.insert(params.end(), it->second.values.begin(), it->second.values.end());
  }
  out.metadata["format"] = "distopt-params/1";
  out.metadata["model"] = text_of(l.body, "model");
  out.metadata["step"] = std::to_string(l.manifest.step);
  if (l.body.contains("config") && l.body["config"].is_object()) {
    // What distopt sample needs besides the shapes (the run's flags).
    const nlohmann::json& c = l.body["config"];
    for (const char* key : {"heads", "layers"})
      if (c.contains(key) && c[key].is_number_unsigned()) out.metadata[key] = std::to_string(c[key].get<std::uint64_t>());
  }
  if (!order.empty()) out.metadata["param_hash"] = train::hash_params(params);
  checkpoint::write_safetensors(a.output, out);
  std::printf("wrote %s: %zu tensors from %s (step %llu)\n", a.output.c_str(), out.slots.size(), l.dir.string().c_str(),
              static_cast<unsigned long long>(l.manifest.step));
  return 0;
}

int run_inspect(const CheckpointArgs& a) {
  const Loaded l = load(a.dir);
  std::uint64_t bytes = 0;
  for (const auto& f : l.manifest.files) bytes += f.bytes;
  if (a.json) {
    nlohmann::ordered_json j;
    j["dir"] = l.dir.string();
    j["step"] = l.manifest.step;
    for (const char* key : {"epoch", "world", "strategy", "model", "optimizer"})
      if (l.body.contains(key)) j[key] = l.body[key];
    j["files"] = nlohmann::ordered_json::array();
    for (const auto& f : l.manifest.files) j["files"].push_back({{"name", f.name}, {"bytes", f.bytes}});
    j["tensors"] = nlohmann::ordered_json::object();
    for (const auto& [name, whole] : l.wholes) j["tensors"][name] = whole.shape;
    if (l.body.contains("config")) j["config"] = l.body["config"];
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("%s: step %llu, epoch %s; %s on %s ranks (%s), optimizer %s\n", l.dir.string().c_str(),
              static_cast<unsigned long long>(l.manifest.step), text_of(l.body, "epoch").c_str(),
              text_of(l.body, "model").c_str(), text_of(l.body, "world").c_str(), text_of(l.body, "strategy").c_str(),
              text_of(l.body, "optimizer").c_str());
  std::printf("%zu files, %llu bytes, checksums verified\n", l.manifest.files.size(),
              static_cast<unsigned long long>(bytes));
  for (const auto& [name, whole] : l.wholes)
    std::printf("  %-32s %s%s\n", name.c_str(), to_string(whole.shape).c_str(),
                is_scales(name) ? "  (block scales of quantized state)" : "");
  return 0;
}

}  // namespace

Runner add_checkpoint(CLI::App& app) {
  auto a = std::make_shared<CheckpointArgs>();
  CLI::App* sub = app.add_subcommand("checkpoint", "export or inspect a checkpoint of distopt train --checkpoint-dir");
  sub->require_subcommand(1);
  CLI::App* exp = sub->add_subcommand("export", "write the unsharded parameters (and optimizer state) as one safetensors file");
  exp->add_option("dir", a->dir, "a checkpoint directory, or a --checkpoint-dir (its latest complete checkpoint)")
      ->required();
  exp->add_option("-o,--output", a->output, "the safetensors file to write")->required()->check(non_empty());
  exp->add_flag("--optimizer-state", a->optimizer_state,
                "add the optimizer state in torch's state_dict layout (state.<index>.<key>)");
  exp->add_flag("--dequantize", a->dequantize,
                "with --optimizer-state: quantized state (--state-dtype int8|int4; bf16 has no scales) as torch's fp32 "
                "state only, "
                "without its block scales (<key>.absmax)");
  CLI::App* ins = sub->add_subcommand("inspect", "print what a checkpoint holds (verifying its checksums)");
  ins->add_option("dir", a->dir, "a checkpoint directory, or a --checkpoint-dir (its latest complete checkpoint)")
      ->required();
  ins->add_flag("--json", a->json, "print one JSON object");
  return [a, exp] { return exp->parsed() ? run_export(*a) : run_inspect(*a); };
}

}  // namespace distopt::cli
