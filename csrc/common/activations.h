// \brief The hidden-layer activations of fused_ops::ode_mlp and their
// derivatives, as PyTorch defines them, on the host and on the device.
//
// One integer code per activation (kAct* below; fused_ops/ops/_ode.py maps
// the names to the same codes) and one float parameter, used by LeakyReLU
// (negative slope), ELU (alpha) and Softplus (beta; threshold 20 as
// torch.nn.Softplus's default: beta * x > 20 returns x).  The derivative is
// taken at the pre-activation a, as PyTorch's backward formulas give it:
// relu'(0) = 0, leaky_relu'(0) = slope, elu'(a <= 0) = alpha exp(a).
#pragma once

#include <torch/headeronly/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace fused_ops {

enum ActCode : int64_t {
  kActSiLU = 0,
  kActReLU = 1,
  kActLeakyReLU = 2,
  kActELU = 3,
  kActSELU = 4,
  kActGELU = 5,
  kActGELUTanh = 6,
  kActSoftplus = 7,
  kActTanh = 8,
  kActSigmoid = 9,
};
constexpr int64_t kNumActs = 10;

namespace act_detail {
constexpr double kSeluAlpha = 1.6732632423543772848170429916717;
constexpr double kSeluScale = 1.0507009873554804934193349852946;
constexpr double kSqrt1_2 = 0.70710678118654752440;        // 1 / sqrt(2)
constexpr double kInvSqrt2Pi = 0.39894228040143267794;     // 1 / sqrt(2 pi)
constexpr double kSqrt2OverPi = 0.79788456080286535588;    // sqrt(2 / pi)
constexpr double kGeluCubic = 0.044715;
constexpr double kSoftplusThreshold = 20.0;
}  // namespace act_detail

template <typename T>
C10_HOST_DEVICE inline T sigmoid_of(T a) {
  return T(1) / (T(1) + std::exp(-a));
}

// act(a) for code `act` with parameter p.
template <typename T>
C10_HOST_DEVICE inline T activate(int64_t act, T p, T a) {
  using namespace act_detail;
  switch (act) {
    case kActSiLU: return a / (T(1) + std::exp(-a));
    case kActReLU: return a > T(0) ? a : T(0);
    case kActLeakyReLU: return a > T(0) ? a : a * p;
    case kActELU: return a > T(0) ? a : p * (std::exp(a) - T(1));
    case kActSELU: return T(kSeluScale) * (a > T(0) ? a : T(kSeluAlpha) * (std::exp(a) - T(1)));
    case kActGELU: return T(0.5) * a * (T(1) + std::erf(a * T(kSqrt1_2)));
    case kActGELUTanh: {
      const T u = T(kSqrt2OverPi) * (a + T(kGeluCubic) * a * a * a);
      return T(0.5) * a * (T(1) + std::tanh(u));
    }
    case kActSoftplus:
      return a * p > T(kSoftplusThreshold) ? a : std::log1p(std::exp(a * p)) / p;
    case kActTanh: return std::tanh(a);
    default: return sigmoid_of(a);  // kActSigmoid
  }
}

// d act / d a at a.
template <typename T>
C10_HOST_DEVICE inline T activate_grad(int64_t act, T p, T a) {
  using namespace act_detail;
  switch (act) {
    case kActSiLU: {
      const T s = sigmoid_of(a);
      return s * (T(1) + a * (T(1) - s));
    }
    case kActReLU: return a > T(0) ? T(1) : T(0);
    case kActLeakyReLU: return a > T(0) ? T(1) : p;
    case kActELU: return a > T(0) ? T(1) : p * std::exp(a);
    case kActSELU: return T(kSeluScale) * (a > T(0) ? T(1) : T(kSeluAlpha) * std::exp(a));
    case kActGELU:
      return T(0.5) * (T(1) + std::erf(a * T(kSqrt1_2))) + a * T(kInvSqrt2Pi) * std::exp(T(-0.5) * a * a);
    case kActGELUTanh: {
      const T u = T(kSqrt2OverPi) * (a + T(kGeluCubic) * a * a * a);
      const T th = std::tanh(u);
      return T(0.5) * (T(1) + th) +
             T(0.5) * a * (T(1) - th * th) * T(kSqrt2OverPi) * (T(1) + T(3 * kGeluCubic) * a * a);
    }
    case kActSoftplus: {
      if (a * p > T(kSoftplusThreshold)) return T(1);
      const T z = std::exp(a * p);
      return z / (z + T(1));
    }
    case kActTanh: {
      const T th = std::tanh(a);
      return T(1) - th * th;
    }
    default: {  // kActSigmoid
      const T s = sigmoid_of(a);
      return s * (T(1) - s);
    }
  }
}

// Host loops: f(std::integral_constant<int64_t, code>{}) for the runtime code
// `act`, so that a loop calling activate / activate_grad with the constant
// sees its switch folded away (ReLU and LeakyReLU then vectorise).
template <typename F>
inline void with_activation(int64_t act, F&& f) {
  switch (act) {
    case kActSiLU: return f(std::integral_constant<int64_t, kActSiLU>{});
    case kActReLU: return f(std::integral_constant<int64_t, kActReLU>{});
    case kActLeakyReLU: return f(std::integral_constant<int64_t, kActLeakyReLU>{});
    case kActELU: return f(std::integral_constant<int64_t, kActELU>{});
    case kActSELU: return f(std::integral_constant<int64_t, kActSELU>{});
    case kActGELU: return f(std::integral_constant<int64_t, kActGELU>{});
    case kActGELUTanh: return f(std::integral_constant<int64_t, kActGELUTanh>{});
    case kActSoftplus: return f(std::integral_constant<int64_t, kActSoftplus>{});
    case kActTanh: return f(std::integral_constant<int64_t, kActTanh>{});
    default: return f(std::integral_constant<int64_t, kActSigmoid>{});
  }
}

}  // namespace fused_ops
