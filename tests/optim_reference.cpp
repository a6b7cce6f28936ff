#include "optim_reference.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace distopt::reference {

namespace {
double num(const OptionMap& o, const char* k) { return o.at(k).number(); }
bool flag(const OptionMap& o, const char* k) { return o.at(k).flag(); }
double first(const OptionMap& o, const char* k) { return o.at(k).pair()[0]; }
double second(const OptionMap& o, const char* k) { return o.at(k).pair()[1]; }
double sgn(double x) { return x > 0 ? 1.0 : (x < 0 ? -1.0 : 0.0); }
}  // namespace

void step(const std::string& rule, const OptionMap& o, std::vector<double>& p, const std::vector<double>& grad,
          State& st) {
  const std::size_t n = p.size();
  auto& T = st.tensors;
  auto& S = st.scalars;
  auto zeros = [&](const char* k, double v = 0.0) {
    if (!T.count(k)) T[k] = std::vector<double>(n, v);
    return &T[k];
  };
  const bool first_step = !st.initialized;
  st.initialized = true;
  std::vector<double> g = grad;
  if (o.count("maximize") && flag(o, "maximize"))
    for (double& x : g) x = -x;
  const double lr = num(o, "lr");

  if (rule == "sgd") {
    const double mom = num(o, "momentum"), damp = num(o, "dampening"), wd = num(o, "weight_decay");
    for (std::size_t i = 0; i < n; ++i) g[i] += wd * p[i];
    if (mom != 0) {
      auto* b = zeros("momentum_buffer");
      for (std::size_t i = 0; i < n; ++i) {
        (*b)[i] = first_step ? g[i] : mom * (*b)[i] + (1 - damp) * g[i];
        g[i] = flag(o, "nesterov") ? g[i] + mom * (*b)[i] : (*b)[i];
      }
    }
    for (std::size_t i = 0; i < n; ++i) p[i] -= lr * g[i];
  } else if (rule == "adam" || rule == "adamw") {
    const double b1 = first(o, "betas"), b2 = second(o, "betas"), eps = num(o, "eps"), wd = num(o, "weight_decay");
    const bool decoupled = rule == "adamw" || flag(o, "decoupled_weight_decay");
    const double t = S["step"] += 1;
    auto *m = zeros("exp_avg"), *v = zeros("exp_avg_sq"), *vmax = zeros("max_exp_avg_sq");
    for (std::size_t i = 0; i < n; ++i) {
      if (decoupled) p[i] *= 1 - lr * wd;
      else g[i] += wd * p[i];
      (*m)[i] += (1 - b1) * (g[i] - (*m)[i]);
      (*v)[i] = b2 * (*v)[i] + (1 - b2) * g[i] * g[i];
      double vv = (*v)[i];
      if (flag(o, "amsgrad")) vv = (*vmax)[i] = std::max((*vmax)[i], vv);
      const double denom = std::sqrt(vv) / std::sqrt(1 - std::pow(b2, t)) + eps;
      p[i] -= lr / (1 - std::pow(b1, t)) * (*m)[i] / denom;
    }
  } else if (rule == "adamax") {
    const double b1 = first(o, "betas"), b2 = second(o, "betas"), eps = num(o, "eps"), wd = num(o, "weight_decay");
    const double t = S["step"] += 1;
    auto *m = zeros("exp_avg"), *u = zeros("exp_inf");
    for (std::size_t i = 0; i < n; ++i) {
      g[i] += wd * p[i];
      (*m)[i] = b1 * (*m)[i] + (1 - b1) * g[i];
      (*u)[i] = std::max(b2 * (*u)[i], std::fabs(g[i]) + eps);
      p[i] -= lr / (1 - std::pow(b1, t)) * (*m)[i] / (*u)[i];
    }
  } else if (rule == "adadelta") {
    const double rho = num(o, "rho"), eps = num(o, "eps"), wd = num(o, "weight_decay");
    S["step"] += 1;
    auto *v = zeros("square_avg"), *u = zeros("acc_delta");
    for (std::size_t i = 0; i < n; ++i) {
      g[i] += wd * p[i];
      (*v)[i] = rho * (*v)[i] + (1 - rho) * g[i] * g[i];
      const double d = std::sqrt((*u)[i] + eps) / std::sqrt((*v)[i] + eps) * g[i];
      (*u)[i] = rho * (*u)[i] + (1 - rho) * d * d;
      p[i] -= lr * d;
    }
  } else if (rule == "adagrad") {
    const double wd = num(o, "weight_decay"), eps = num(o, "eps");
    const double t = S["step"] += 1;
    auto* s = zeros("sum", num(o, "initial_accumulator_value"));
    const double clr = lr / (1 + (t - 1) * num(o, "lr_decay"));
    for (std::size_t i = 0; i < n; ++i) {
      g[i] += wd * p[i];
      (*s)[i] += g[i] * g[i];
      p[i] -= clr * g[i] / (std::sqrt((*s)[i]) + eps);
    }
  } else if (rule == "rmsprop") {
    const double a = num(o, "alpha"), eps = num(o, "eps"), wd = num(o, "weight_decay"), mom = num(o, "momentum");
    S["step"] += 1;
    auto *v = zeros("square_avg"), *b = zeros("momentum_buffer"), *ga = zeros("grad_avg");
    for (std::size_t i = 0; i < n; ++i) {
      g[i] += wd * p[i];
      (*v)[i] = a * (*v)[i] + (1 - a) * g[i] * g[i];
      double avg;
      if (flag(o, "centered")) {
        (*ga)[i] = a * (*ga)[i] + (1 - a) * g[i];
        avg = std::sqrt((*v)[i] - (*ga)[i] * (*ga)[i]);
      } else {
        avg = std::sqrt((*v)[i]);
      }
      avg += eps;
      if (mom > 0) {
        (*b)[i] = mom * (*b)[i] + g[i] / avg;
        p[i] -= lr * (*b)[i];
      } else {
        p[i] -= lr * g[i] / avg;
      }
    }
  } else if (rule == "nadam") {
    const double b1 = first(o, "betas"), b2 = second(o, "betas"), eps = num(o, "eps"), wd = num(o, "weight_decay");
    const double psi = num(o, "momentum_decay");
    if (!S.count("mu_product")) S["mu_product"] = 1.0;
    const double t = S["step"] += 1;
    const double mu = b1 * (1 - 0.5 * std::pow(0.96, t * psi));
    const double mu_next = b1 * (1 - 0.5 * std::pow(0.96, (t + 1) * psi));
    const double prod = S["mu_product"] *= mu;
    const double prod_next = prod * mu * mu_next;  // torch 1.13
    auto *m = zeros("exp_avg"), *v = zeros("exp_avg_sq");
    for (std::size_t i = 0; i < n; ++i) {
      if (flag(o, "decoupled_weight_decay")) p[i] *= 1 - lr * wd;
      else g[i] += wd * p[i];
      (*m)[i] = b1 * (*m)[i] + (1 - b1) * g[i];
      (*v)[i] = b2 * (*v)[i] + (1 - b2) * g[i] * g[i];
      const double denom = std::sqrt((*v)[i] / (1 - std::pow(b2, t))) + eps;
      p[i] -= lr * (1 - mu) / (1 - prod) * g[i] / denom;
      p[i] -= lr * mu_next / (1 - prod_next) * (*m)[i] / denom;
    }
  } else if (rule == "radam") {
    const double b1 = first(o, "betas"), b2 = second(o, "betas"), eps = num(o, "eps"), wd = num(o, "weight_decay");
    const double t = S["step"] += 1;
    auto *m = zeros("exp_avg"), *v = zeros("exp_avg_sq");
    const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    const double rho_inf = 2 / (1 - b2) - 1;
    const double rho_t = rho_inf - 2 * t * std::pow(b2, t) / bc2;
    for (std::size_t i = 0; i < n; ++i) {
      if (flag(o, "decoupled_weight_decay")) p[i] *= 1 - lr * wd;
      else g[i] += wd * p[i];
      (*m)[i] = b1 * (*m)[i] + (1 - b1) * g[i];
      (*v)[i] = b2 * (*v)[i] + (1 - b2) * g[i] * g[i];
      const double mhat = (*m)[i] / bc1;
      if (rho_t > 5) {
        const double r = std::sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t));
        p[i] -= lr * mhat * r * std::sqrt(bc2) / (std::sqrt((*v)[i]) + eps);
      } else {
        p[i] -= lr * mhat;
      }
    }
  } else if (rule == "rprop") {
    const double em = first(o, "etas"), ep = second(o, "etas");
    const double smin = first(o, "step_sizes"), smax = second(o, "step_sizes");
    S["step"] += 1;
    auto *prev = zeros("prev"), *ss = zeros("step_size", lr);
    for (std::size_t i = 0; i < n; ++i) {
      const double s = sgn(g[i] * (*prev)[i]);
      const double f = s > 0 ? ep : (s < 0 ? em : 1.0);
      (*ss)[i] = std::clamp((*ss)[i] * f, smin, smax);
      if (s < 0) g[i] = 0;
      p[i] -= sgn(g[i]) * (*ss)[i];
      (*prev)[i] = g[i];
    }
  } else if (rule == "asgd") {
    const double lambd = num(o, "lambd"), alpha = num(o, "alpha"), t0 = num(o, "t0"), wd = num(o, "weight_decay");
    if (!S.count("eta")) {
      S["eta"] = lr;
      S["mu"] = 1;
    }
    const double t = S["step"] += 1;
    auto* ax = zeros("ax");
    for (std::size_t i = 0; i < n; ++i) {
      g[i] += wd * p[i];
      p[i] = p[i] * (1 - lambd * S["eta"]) - S["eta"] * g[i];
      (*ax)[i] = S["mu"] != 1 ? (*ax)[i] + S["mu"] * (p[i] - (*ax)[i]) : p[i];
    }
    S["eta"] = lr / std::pow(1 + lambd * lr * t, alpha);
    S["mu"] = 1 / std::max(1.0, t - t0);
  } else if (rule == "lion") {
    const double b1 = first(o, "betas"), b2 = second(o, "betas"), wd = num(o, "weight_decay");
    auto* m = zeros("exp_avg");
    for (std::size_t i = 0; i < n; ++i) {
      p[i] *= 1 - lr * wd;
      p[i] -= lr * sgn(b1 * (*m)[i] + (1 - b1) * g[i]);
      (*m)[i] = b2 * (*m)[i] + (1 - b2) * g[i];
    }
  } else {
    throw std::invalid_argument("no reference for " + rule);
  }
}

}  // namespace distopt::reference
