// distopt sample: text from a gpt parameter file (--export-params or
// `distopt checkpoint export`), so that a user sees what a run learned.
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "commands.hpp"
#include "distopt/checkpoint/safetensors.hpp"
#include "distopt/core/error.hpp"
#include "distopt/core/random.hpp"
#include "distopt/models/model.hpp"

namespace distopt::cli {
namespace {

struct SampleArgs {
  std::string params, prompt;
  std::size_t tokens = 200, heads = 0;
  double temperature = 0.8;
  std::uint64_t seed = 0;
};

const ParamSlot* find(const checkpoint::NamedTensors& t, const std::string& name) {
  for (const ParamSlot& s : t.slots)
    if (s.name == name) return &s;
  return nullptr;
}

// The gpt shape a parameter file holds: dim and vocabulary from wte,
// context from wpe, layers from the blocks, heads from its metadata (or
// --heads); then every tensor checked against that model's.
models::GptShape shape_of(const checkpoint::NamedTensors& t, const SampleArgs& a) {
  const ParamSlot* wte = find(t, "wte");
  const ParamSlot* wpe = find(t, "wpe");
  if (wte == nullptr || wpe == nullptr || wte->shape.size() != 2 || wpe->shape.size() != 2)
    throw InvalidInput(str(a.params, ": not a gpt parameter file (no wte and wpe matrices)"));
  models::GptShape s;
  s.vocab = static_cast<std::size_t>(wte->shape[0]);
  s.dim = static_cast<std::size_t>(wte->shape[1]);
  s.context = static_cast<std::size_t>(wpe->shape[0]);
  std::set<std::size_t> blocks;
  for (const ParamSlot& p : t.slots)
    if (p.name.rfind("h.", 0) == 0) blocks.insert(std::stoul(p.name.substr(2)));
  s.layers = blocks.size();
  if (a.heads > 0) {
    s.heads = a.heads;
  } else if (const auto it = t.metadata.find("heads"); it != t.metadata.end()) {
    s.heads = std::stoul(it->second);
  } else {
    throw InvalidInput(str(a.params, " does not record the number of heads: give --heads"));
  }
  if (s.vocab != 256) throw InvalidInput(str(a.params, ": wte has ", s.vocab, " rows; distopt's gpt reads 256 byte tokens"));
  return s;
}

int run_sample(const SampleArgs& a) {
  if (!(a.temperature >= 0 && std::isfinite(a.temperature)))
    throw InvalidInput(str("--temperature must be a non-negative number (got ", a.temperature, ")"));
  if (a.prompt.empty()) throw InvalidInput("--prompt needs at least one byte of text");
  const checkpoint::NamedTensors t = checkpoint::read_safetensors(a.params);
  const models::GptShape shape = shape_of(t, a);
  auto model = models::make_gpt(shape);
  std::vector<float> buffer(model->buffer_elements(), 0.0f);
  std::set<std::string> known;
  for (const ParamSlot& p : model->params()) {
    known.insert(p.name);
    const ParamSlot* f = find(t, p.name);
    if (f == nullptr) throw InvalidInput(str(a.params, " has no tensor ", p.name, " (a gpt of its shape needs it)"));
    if (f->shape != p.shape)
      throw InvalidInput(str(a.params, ": ", p.name, " is ", to_string(f->shape), "; a gpt with --dim ", shape.dim,
                             " --context ", shape.context, " --heads ", shape.heads, " needs ", to_string(p.shape)));
    std::copy_n(t.data.begin() + static_cast<std::ptrdiff_t>(f->offset), p.numel(),
                buffer.begin() + static_cast<std::ptrdiff_t>(p.offset));
  }
  for (const ParamSlot& p : t.slots)
    if (!known.count(p.name)) throw InvalidInput(str(a.params, ": tensor ", p.name, " is not a gpt parameter"));

  std::vector<std::uint32_t> text(a.prompt.begin(), a.prompt.end());
  for (auto& c : text) c &= 0xffu;
  std::fwrite(a.prompt.data(), 1, a.prompt.size(), stdout);
  Rng rng(a.seed, 0x5a3b1e);
  for (std::size_t k = 0; k < a.tokens; ++k) {
    const std::size_t n = std::min(text.size(), shape.context);
    const std::vector<float> logits =
        models::gpt_next_logits(*model, buffer, std::span<const std::uint32_t>(text).subspan(text.size() - n));
    std::size_t next = 0;
    if (a.temperature == 0) {
      for (std::size_t j = 1; j < logits.size(); ++j)
        if (logits[j] > logits[next]) next = j;
    } else {
      double mx = logits[0];
      for (float v : logits) mx = std::max(mx, double(v));
      std::vector<double> p(logits.size());
      double sum = 0;
      for (std::size_t j = 0; j < logits.size(); ++j) sum += p[j] = std::exp((logits[j] - mx) / a.temperature);
      double u = rng.uniform() * sum;
      for (next = 0; next + 1 < p.size() && u >= p[next]; ++next) u -= p[next];
    }
    text.push_back(static_cast<std::uint32_t>(next));
    std::fputc(static_cast<int>(next), stdout);
  }
  std::fputc('\n', stdout);
  return 0;
}

}  // namespace

Runner add_sample(CLI::App& app) {
  auto a = std::make_shared<SampleArgs>();
  CLI::App* sub = app.add_subcommand("sample", "generate text with a gpt parameter file (--export-params, checkpoint export)");
  sub->add_option("--params", a->params, "the safetensors file of a gpt run")->required()->check(non_empty());
  sub->add_option("--prompt", a->prompt, "text to continue")->required();
  sub->add_option("--tokens", a->tokens, "bytes to generate (default 200)")->check(non_negative("integer"));
  sub->add_option("--temperature", a->temperature, "softmax temperature; 0 takes the most likely byte (default 0.8)");
  sub->add_option("--seed", a->seed, "sampling seed (default 0)")->check(non_negative("integer"));
  sub->add_option("--heads", a->heads, "attention heads, when the file does not record them")->check(non_negative("integer"));
  return [a] { return run_sample(*a); };
}

}  // namespace distopt::cli
