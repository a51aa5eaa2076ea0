// \brief Division by a run-time constant divisor, prepared on the host.
//
// A 32-bit integer division on the GPU is a ~20-instruction software
// sequence.  Persistent kernels that map a flat thread index to (row, column,
// segment) coordinates every layer of every step pay it in their hottest
// loops, where the divisors never change during the launch.  With the
// multiplier and shift computed once on the host (Granlund & Montgomery's
// round-up method), a quotient is one __umulhi, one add and one shift.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fused_ops {
namespace cuda {

struct IntDivider {
  unsigned divisor = 1, magic = 0, shift = 0;

  IntDivider() = default;
  // Valid for 1 <= d < 2^31 and dividends 0 <= n < 2^31 (then __umulhi(n,
  // magic) + n cannot overflow 32 bits).
  explicit IntDivider(unsigned d) : divisor(d) {
    while (shift < 32 && (1ull << shift) < d) ++shift;  // shift = ceil(log2 d)
    magic = unsigned(((1ull << 32) * ((1ull << shift) - d)) / d + 1);
  }

  __device__ __forceinline__ unsigned div(unsigned n) const { return (__umulhi(n, magic) + n) >> shift; }
  // (quotient, remainder) of n.
  __device__ __forceinline__ void divmod(unsigned n, unsigned& q, unsigned& r) const {
    q = div(n);
    r = n - q * divisor;
  }
};

}  // namespace cuda
}  // namespace fused_ops
