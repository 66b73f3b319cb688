// Products of a few rows of activations with large weights — the decode path of every
// projection and LM head — at the memory bandwidth, for float32, int8 (a scale per output
// channel) and int4 (a scale and a minimum per group of inputs) weights.
//
// Why not PyTorch's own products: for one to a few rows against weights far larger than
// the caches, the BLAS path streams weights well below the copy bandwidth on some CPUs,
// and its int8 path slower still (docs/kernels.md has the figures). Here each weight row
// is read once for every row of x, and the result of an output never depends on the
// rows beside it, the threads or the instruction set (rows_times_weight.h).
//
// Built on first use by hydra_jury.hydra_model.kernels (and by `make setup`).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

// One call: x [S, rows, inputs] (member stride x_member, 0 when every member reads the
// same rows; row stride x_row), weights [S, outputs, inputs], y [S, rows, outputs].
struct Problem {
  const float* x;
  int64_t members, rows, inputs, outputs, x_member, x_row;
  float* y;
};

// Splits every member's outputs over the threads; fn(member, first, last).
template <class Fn>
void for_each_range(const Problem& p, const Fn& fn) {
  // A grain of 64 outputs: a thread's share of a tiny matrix is not worth a wake-up.
  at::parallel_for(0, p.members * p.outputs, 64, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      int64_t member = begin / p.outputs, first = begin % p.outputs;
      int64_t last = std::min(p.outputs, first + (end - begin));
      fn(member, first, last);
      begin += last - first;
    }
  });
}

namespace scalar {
#include "lanes_scalar.h"
#include "rows_times_weight.h"
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "lanes_avx2.h"
#include "rows_times_weight.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
namespace avx512 {
#include "lanes_avx512.h"
#include "rows_times_weight.h"
}  // namespace avx512
#pragma GCC pop_options

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
const char* const kIsaNames[] = {"scalar", "avx2", "avx512"};

int best_supported() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  return kScalar;
}

// The best this CPU has, lowered as PyTorch's ATEN_CPU_CAPABILITY asks ("default",
// "avx2"), so that `make test-numerics` runs these kernels on every path too.
int initial_isa() {
  int isa = best_supported();
  const char* asked = std::getenv("ATEN_CPU_CAPABILITY");
  if (asked == nullptr) return isa;
  std::string name(asked);
  if (name == "default") return kScalar;
  if (name == "avx2") return std::min(isa, static_cast<int>(kAvx2));
  return isa;
}

std::atomic<int> current_isa{initial_isa()};

std::string kernel_isa(std::string requested) {
  if (!requested.empty()) {
    int wanted = -1;
    for (int i = 0; i < 3; ++i)
      if (requested == kIsaNames[i]) wanted = i;
    TORCH_CHECK(wanted >= 0, "unknown instruction set '", requested,
                "'; expected scalar, avx2 or avx512");
    TORCH_CHECK(wanted <= best_supported(), "this CPU does not support ", requested);
    current_isa = wanted;
  }
  return kIsaNames[current_isa.load()];
}

Problem problem_of(const at::Tensor& x, const at::Tensor& weight, int64_t inputs, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 3 && weight.dim() == 3, "x must be [S, rows, inputs] and the weight "
              "[S, outputs, inputs]");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32, not ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.size(2) == inputs, "x has ", x.size(2), " inputs, the weight ", inputs);
  TORCH_CHECK(inputs % 32 == 0, "the number of inputs must be a multiple of 32, not ", inputs);
  TORCH_CHECK(x.size(0) == weight.size(0) || x.stride(0) == 0,
              "x and the weight have different stack sizes");
  TORCH_CHECK(x.stride(2) == 1 && weight.is_contiguous(), "inputs must be contiguous");
  int64_t members = weight.size(0), rows = x.size(1), outputs = weight.size(1);
  y = at::empty({members, rows, outputs}, x.options().memory_format(at::MemoryFormat::Contiguous));
  return Problem{x.data_ptr<float>(), members, rows, inputs, outputs,
                 members == 1 ? 0 : x.stride(0), x.stride(1), y.data_ptr<float>()};
}

at::Tensor rows_times_float32(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "the weight must be float32");
  at::Tensor y;
  Problem p = problem_of(x, weight, weight.size(2), y);
  const float* w = weight.data_ptr<float>();
  switch (current_isa.load()) {
    case kAvx512: avx512::float32(p, w); break;
    case kAvx2: avx2::float32(p, w); break;
    default: scalar::float32(p, w);
  }
  return y;
}

at::Tensor rows_times_int8(const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& scale) {
  TORCH_CHECK(weight.scalar_type() == at::kChar, "an int8 weight must be int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.dim() == 2 && scale.size(0) == weight.size(0) &&
                  scale.size(1) == weight.size(1),
              "an int8 weight's scale must be float32 [S, outputs]");
  at::Tensor y;
  Problem p = problem_of(x, weight, weight.size(2), y);
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scale.data_ptr<float>();
  switch (current_isa.load()) {
    case kAvx512: avx512::int8(p, w, s); break;
    case kAvx2: avx2::int8(p, w, s); break;
    default: scalar::int8(p, w, s);
  }
  return y;
}

at::Tensor rows_times_int4(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                           const at::Tensor& minimum, int64_t group) {
  TORCH_CHECK(weight.scalar_type() == at::kByte, "an int4 weight must be packed in uint8");
  int64_t inputs = weight.size(2) * 2;
  TORCH_CHECK(group > 0 && group % 32 == 0 && inputs % group == 0,
              "the group size must be a multiple of 32 that divides the inputs");
  for (const at::Tensor* t : {&scale, &minimum})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == weight.size(0) && t->size(1) == weight.size(1) &&
                    t->size(2) == inputs / group,
                "an int4 weight's scale and minimum must be float32 [S, outputs, groups]");
  at::Tensor y;
  Problem p = problem_of(x, weight, inputs, y);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const float *s = scale.data_ptr<float>(), *m = minimum.data_ptr<float>();
  switch (current_isa.load()) {
    case kAvx512: avx512::int4(p, w, s, m, group); break;
    case kAvx2: avx2::int4(p, w, s, m, group); break;
    default: scalar::int4(p, w, s, m, group);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(hydra_jury, m) {
  m.def("rows_times_float32(Tensor x, Tensor weight) -> Tensor", rows_times_float32);
  m.def("rows_times_int8(Tensor x, Tensor weight, Tensor scale) -> Tensor", rows_times_int8);
  m.def("rows_times_int4(Tensor x, Tensor weight, Tensor scale, Tensor minimum, int group) -> Tensor",
        rows_times_int4);
  m.def("kernel_isa(str requested) -> str", kernel_isa);
}
