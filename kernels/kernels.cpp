// Products of a few rows of activations with large weights — the decode path of every
// projection and LM head — at the memory bandwidth, for float32, int8 (a scale per output
// channel) and int4 (a scale and a minimum per group of inputs) weights; the quantized
// ones either with float activations or with activations quantized to int8 per block of
// 32 inputs, multiplied in integers (as llama.cpp's Q8_0 and Q4_1 are).
//
// Why not PyTorch's own products: for one to a few rows against weights far larger than
// the caches, the BLAS path streams weights well below the copy bandwidth on some CPUs,
// and its int8 path slower still (docs/kernels.md has the figures). Here each weight row
// is read once for every row of x, and the result of an output never depends on the
// rows beside it, the threads or the instruction set (rows_times_weight.h).
//
// Built on first use by hydra_jury.kernels (and by `make setup`).

// The headers of what is used, not <ATen/ATen.h>: a fresh build (`make setup`) 4 s shorter.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

// One call: x [S, rows, inputs] (member stride x_member, 0 when every member reads the
// same rows; row stride x_row), weights [S, outputs, inputs], y [S, rows, outputs], and
// an optional residual added to y (shaped as y, its member and row strides given).
struct Problem {
  const float* x;
  int64_t members, rows, inputs, outputs, x_member, x_row;
  float* y;
  const float* residual = nullptr;
  int64_t residual_member = 0, residual_row = 0;
};

// Rows of activations as the kernels read them: [sources, rows, width] floats with
// contiguous inputs, sources apart by `member` (0, or one source, when every stack member
// reads the same rows) and rows by `row`.
struct Activations {
  const float* data;
  int64_t sources, rows, width, member, row;
};

Activations activations_of(const at::Tensor& x) {
  return {x.data_ptr<float>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1)};
}

// The threads of one parallel region that run a whole sequence of products and attentions
// between them (decode_layers): each takes its share of every step and waits for the
// others at a barrier before the next step reads what they wrote. One region for a decode
// step's 31 layers instead of five per layer: every region wakes the threads and waits for
// the last, and everything between the regions (preparing a product's input, adding its
// residual) ran on one thread while the others waited.
class Team {
 public:
  int size = 1;

  // Returns once every member of the team has called it (as often as this one).
  void wait() {
    if (size == 1) return;
    int phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == size - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    // Spin while the others are a few microseconds away, then give the core up: a thread
    // the OS has descheduled (more threads than cores) must not be starved by the spinners.
    for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
      if (spins < 4096) _mm_pause();
      else std::this_thread::yield();
    }
  }

 private:
  std::atomic<int> arrived_{0}, phase_{0};
};

// The team this thread works in and its rank there; none outside decode_layers' region.
struct Seat {
  Team* team = nullptr;
  int rank = 0;
};
thread_local Seat seat;

// Activations quantized to int8 per block of 32 inputs (quantized_rows), row after row
// ([sources, rows] of them), each row padded with zeros to a whole number of chunks of
// 64: q [.., padded] and q + 128 as bytes; per lane of 4 inputs (padded / 4 a row) the
// step d of the lane's block; and per block (block_row floats a row, zeros past the
// row's blocks up to a multiple of 16) d times the sum of the block's q, which an int4
// weight's minimums multiply (rows_times_weight.h).
struct QuantizedRows {
  const int8_t* q;
  const uint8_t* biased;
  const float *step, *block_sum;
  int64_t padded, block_row;
  int64_t member_rows;  // rows between stack members (0: shared rows)
};

// One layer's attention for one session (attention.h): qkv [S, T, (heads + 2 kv_heads) *
// dim] with member and row strides; that layer's cache, keys/values [S, kv_heads,
// capacity, dim] with member and head strides; cos/sin [T, dim] of positions start..;
// out [S, T, heads * dim].
struct AttentionProblem {
  const float* qkv;
  int64_t members, rows, qkv_member, qkv_row;
  float *keys, *values;
  int64_t cache_member, cache_head;
  const float *cos, *sin;
  int64_t start, heads, kv_heads, dim;
  float* out;  // [S, T, heads * dim] rows, its members out_member floats apart
  int64_t out_member;
};

// What a round reads of one target row besides its log-probabilities and probabilities
// (vocabulary.h's target_row).
struct TargetRow {
  float entropy, margin;
  int64_t greedy;
};

// Splits every member's outputs over the threads (over a team's, inside its region;
// else over PyTorch's); fn(member, first, last), then the residual added to those outputs.
template <class Fn>
void for_each_range(const Problem& p, const Fn& fn) {
  auto range = [&](int64_t begin, int64_t end) {
    while (begin < end) {
      int64_t member = begin / p.outputs, first = begin % p.outputs;
      int64_t last = std::min(p.outputs, first + (end - begin));
      fn(member, first, last);
      if (p.residual != nullptr)
        for (int64_t r = 0; r < p.rows; ++r) {
          float* y = p.y + (member * p.rows + r) * p.outputs;
          const float* add = p.residual + member * p.residual_member + r * p.residual_row;
          for (int64_t o = first; o < last; ++o) y[o] += add[o];
        }
      begin += last - first;
    }
  };
  int64_t total = p.members * p.outputs;
  if (seat.team != nullptr) {
    // Shares of whole tiles of 16 outputs (the tiles in rows_times_weight.h divide it).
    int64_t share = ((total + seat.team->size - 1) / seat.team->size + 15) / 16 * 16;
    int64_t begin = std::min(total, seat.rank * share);
    range(begin, std::min(total, begin + share));
    return;
  }
  // A grain of 64 outputs: a thread's share of a tiny matrix is not worth a wake-up.
  at::parallel_for(0, total, 64, range);
}

namespace scalar {
#include "lanes_scalar.h"
#include "rows_times_weight.h"
#include "vocabulary.h"
#include "attention.h"
#include "gates.h"
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "lanes_avx2.h"
#include "rows_times_weight.h"
#include "vocabulary.h"
#include "attention.h"
#include "gates.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")
namespace avx512 {
#include "lanes_avx512.h"
#include "rows_times_weight.h"
#include "vocabulary.h"
#include "attention.h"
#include "gates.h"
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

// The integer products need VNNI (dpbusd) at AVX-512; without it they run the AVX2 code,
// which gives the same bits.
bool has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
}

const bool vnni = has_vnni();

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

// x's rows as a product reads them, written into `out` ([outs, rows, inputs], contiguous):
// with `glu`, x holds [gate, up] and the input is silu(gate) * up; with `norm` [outs,
// inputs], the input is x's RMS-normalised rows times norm (one set per stack member).
void prepare_rows(const Activations& x, const float* norm, double eps, bool glu, int64_t outs,
                  float* out) {
  int64_t inputs = glu ? x.width / 2 : x.width;
  // Vectorized: a batch of 8 sessions gates 8 rows of 1,536 inputs in each of SmolLM2's
  // layers.
  int isa = current_isa.load();
  auto gate_row = isa == kAvx512 ? avx512::silu_times
                  : isa == kAvx2 ? avx2::silu_times
                                 : scalar::silu_times;
  for (int64_t s = 0; s < outs; ++s)
    for (int64_t r = 0; r < x.rows; ++r) {
      const float* row = x.data + (x.sources == 1 ? 0 : s * x.member) + r * x.row;
      float* target = out + (s * x.rows + r) * inputs;
      if (glu) {
        gate_row(row, row + inputs, inputs, target);
        row = target;
      }
      if (norm != nullptr) {
        float squares = 0.0f;
        for (int64_t k = 0; k < inputs; ++k) squares += row[k] * row[k];
        float inverse = 1.0f / std::sqrt(squares / inputs + static_cast<float>(eps));
        for (int64_t k = 0; k < inputs; ++k) target[k] = row[k] * inverse * norm[s * inputs + k];
      }
    }
}

// The checks of an input [S or 1, rows, width] and of a norm weight [members, inputs].
void check_input(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be a float32 CPU tensor [S, rows, inputs]");
  TORCH_CHECK(x.stride(2) == 1, "x's inputs must be contiguous");
}

const float* checked_norm(const c10::optional<at::Tensor>& norm, int64_t members,
                          int64_t inputs) {
  if (!norm.has_value()) return nullptr;
  TORCH_CHECK(norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->dim() == 2 &&
                  norm->size(0) == members && norm->size(1) == inputs,
              "the norm weight must be float32 [S, inputs]");
  return norm->data_ptr<float>();
}

// x's rows RMS-normalised and scaled by weight [S, inputs] (x [S or 1, rows, inputs]): what a
// product's `norm` does to its input, as an operator of its own, so that a norm outside a
// product (a head's final norm before a shared LM head) has the same bits as one inside.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() == 3 &&
                  (x.size(0) == weight.size(0) || x.size(0) == 1),
              "x must be [S or 1, rows, inputs] for a weight [S, inputs]");
  check_input(x);
  const float* norm = checked_norm(weight, weight.size(0), x.size(2));
  at::Tensor normed = at::empty({weight.size(0), x.size(1), x.size(2)}, x.options());
  prepare_rows(activations_of(x), norm, eps, false, weight.size(0), normed.data_ptr<float>());
  return normed;
}

// x's rows quantized to int8 per block of 32 inputs (quantize_chunk in lanes_*.h, the same
// bits on every set; products.py's PyTorch path computes the same d and q), into buffers
// of this thread's that later calls reuse.
QuantizedRows quantized_rows(const Activations& x, int isa) {
  using Chunk = void (*)(const float*, int8_t*, uint8_t*, float*, float*);
  Chunk chunk = isa == kAvx512 ? avx512::quantize_chunk
                : isa == kAvx2 ? avx2::quantize_chunk
                               : scalar::quantize_chunk;
  bool shared = x.sources == 1 || x.member == 0;
  int64_t sources = shared ? 1 : x.sources, rows = x.rows, inputs = x.width;
  int64_t padded = (inputs + 63) / 64 * 64;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<uint8_t> biased;
  thread_local std::vector<float> step, lane_sum, block_sum;
  q.resize(sources * rows * padded);
  biased.resize(q.size());
  step.resize(sources * rows * padded / 4);
  lane_sum.resize(step.size());
  int64_t block_row = (padded / 32 + 15) / 16 * 16;
  block_sum.assign(sources * rows * block_row, 0.0f);
  for (int64_t s = 0; s < sources; ++s)
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = x.data + s * x.member + r * x.row;
      int64_t at = (s * rows + r) * padded;
      for (int64_t c = 0; c < padded; c += 64) {
        const float* source = row + c;
        float tail[64];  // a last block of 32 inputs, then a block of zeros
        if (c + 64 > inputs) {
          std::memcpy(tail, row + c, 32 * sizeof(float));
          std::fill(tail + 32, tail + 64, 0.0f);
          source = tail;
        }
        chunk(source, q.data() + at + c, biased.data() + at + c, step.data() + (at + c) / 4,
              lane_sum.data() + (at + c) / 4);
      }
      // A block's 8 lane sums are whole numbers below 2^24: their float sum is exact in
      // any order, and its product with d one rounding, the same on every set.
      float* sums = block_sum.data() + (s * rows + r) * block_row;
      for (int64_t b = 0; b < padded / 32; ++b) {
        const float* lanes = lane_sum.data() + at / 4 + b * 8;
        float total = 0.0f;
        for (int l = 0; l < 8; ++l) total += lanes[l];
        sums[b] = step[at / 4 + b * 8] * total;
      }
    }
  return {q.data(), biased.data(), step.data(), block_sum.data(), padded, block_row,
          shared ? 0 : rows};
}

// A weight checked, as the kernels take it. Its format from its dtype: float32 [S, outputs,
// inputs]; int8 [S, outputs, inputs] with scale [S, outputs]; int4 packed uint8 [S,
// outputs, inputs / 2] with scale and minimum [S, outputs, groups]; inputs a multiple of
// 32 (the kernels read blocks of 32).
enum Format { kFloat32, kInt8, kInt4 };

struct MatrixWeight {
  Format format;
  const void* values;
  const float *scale, *minimum;
  int64_t group, members, outputs, inputs;
};

MatrixWeight matrix_weight(const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                           const c10::optional<at::Tensor>& minimum, int64_t group,
                           bool int8_activations) {
  TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous() && weight.device().is_cpu(),
              "the weight must be a contiguous CPU tensor [S, outputs, inputs]");
  int64_t members = weight.size(0), outputs = weight.size(1);
  int64_t inputs = weight.scalar_type() == at::kByte ? weight.size(2) * 2 : weight.size(2);
  TORCH_CHECK(inputs % 32 == 0, "the number of inputs must be a multiple of 32, not ", inputs);
  if (weight.scalar_type() == at::kFloat) {
    TORCH_CHECK(!int8_activations, "int8 activations need an int8 or int4 weight");
    return {kFloat32, weight.data_ptr<float>(), nullptr, nullptr, 0, members, outputs, inputs};
  }
  if (weight.scalar_type() == at::kChar) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat &&
                    scale->is_contiguous() && scale->dim() == 2 && scale->size(0) == members &&
                    scale->size(1) == outputs,
                "an int8 weight's scale must be float32 [S, outputs]");
    return {kInt8, weight.data_ptr<int8_t>(), scale->data_ptr<float>(), nullptr, 0, members,
            outputs, inputs};
  }
  TORCH_CHECK(weight.scalar_type() == at::kByte,
              "the weight must be float32, int8 or packed int4 (uint8)");
  TORCH_CHECK(group > 0 && group % 32 == 0 && inputs % group == 0,
              "the group size must be a multiple of 32 that divides the inputs");
  for (const c10::optional<at::Tensor>* t : {&scale, &minimum})
    TORCH_CHECK(t->has_value() && (*t)->scalar_type() == at::kFloat && (*t)->is_contiguous() &&
                    (*t)->dim() == 3 && (*t)->size(0) == members && (*t)->size(1) == outputs &&
                    (*t)->size(2) == inputs / group,
                "an int4 weight's scale and minimum must be float32 [S, outputs, groups]");
  return {kInt4, weight.data_ptr<uint8_t>(), scale->data_ptr<float>(),
          minimum->data_ptr<float>(), group, members, outputs, inputs};
}

// The set the products of a weight run on: the integer products need VNNI at AVX-512.
int product_isa(bool int8_activations) {
  int isa = current_isa.load();
  return int8_activations && isa == kAvx512 && !vnni ? kAvx2 : isa;
}

// p's products with the weight, on the set `isa`: integer with qx (int8 activations),
// else in float.
void multiply(const Problem& p, const MatrixWeight& m, const QuantizedRows* qx, int isa) {
  if (m.format == kFloat32) {
    const float* w = static_cast<const float*>(m.values);
    if (isa == kAvx512) avx512::float32(p, w);
    else if (isa == kAvx2) avx2::float32(p, w);
    else scalar::float32(p, w);
  } else if (m.format == kInt8) {
    const int8_t* w = static_cast<const int8_t*>(m.values);
    if (qx != nullptr) {
      if (isa == kAvx512) avx512::int8_quantized_rows(p, *qx, w, m.scale);
      else if (isa == kAvx2) avx2::int8_quantized_rows(p, *qx, w, m.scale);
      else scalar::int8_quantized_rows(p, *qx, w, m.scale);
    } else if (isa == kAvx512) avx512::int8(p, w, m.scale);
    else if (isa == kAvx2) avx2::int8(p, w, m.scale);
    else scalar::int8(p, w, m.scale);
  } else {
    const uint8_t* w = static_cast<const uint8_t*>(m.values);
    if (qx != nullptr) {
      if (isa == kAvx512) avx512::int4_quantized_rows(p, *qx, w, m.scale, m.minimum, m.group);
      else if (isa == kAvx2) avx2::int4_quantized_rows(p, *qx, w, m.scale, m.minimum, m.group);
      else scalar::int4_quantized_rows(p, *qx, w, m.scale, m.minimum, m.group);
    } else if (isa == kAvx512) avx512::int4(p, w, m.scale, m.minimum, m.group);
    else if (isa == kAvx2) avx2::int4(p, w, m.scale, m.minimum, m.group);
    else scalar::int4(p, w, m.scale, m.minimum, m.group);
  }
}

// y [S, rows, outputs] = x' W^T (+ residual), x' x's rows prepared (prepare_rows) into a
// buffer of this thread's, then with int8 activations quantized; everything checked by
// the caller. Inside a team's region each thread prepares the input for itself (a few
// microseconds that would otherwise keep the others waiting) and computes its share.
void product_into(const Activations& x, const MatrixWeight& m, const float* norm, double eps,
                  bool glu, const Activations* residual, bool int8_activations, float* y) {
  Activations input = x;
  if (glu || norm != nullptr) {
    thread_local std::vector<float> ready;
    int64_t outs = norm != nullptr ? m.members : x.sources, inputs = m.inputs;
    ready.resize(outs * x.rows * inputs);
    prepare_rows(x, norm, eps, glu, outs, ready.data());
    input = {ready.data(), outs, x.rows, inputs, x.rows * inputs, inputs};
  }
  Problem p{input.data, m.members, input.rows, m.inputs, m.outputs,
            input.sources == 1 ? 0 : input.member, input.row, y};
  if (residual != nullptr) {
    p.residual = residual->data;
    p.residual_member = residual->sources == 1 ? 0 : residual->member;
    p.residual_row = residual->row;
  }
  int isa = product_isa(int8_activations);
  if (int8_activations) {
    QuantizedRows qx = quantized_rows(input, isa);
    multiply(p, m, &qx, isa);
  } else {
    multiply(p, m, nullptr, isa);
  }
}

// y = x' W^T (+ residual), x' the prepared input (prepare_rows); the weight's format from
// its dtype (matrix_weight). With `int8_activations` (int8 and int4 weights), x' is
// quantized to int8 first and the products are integer (rows_times_weight.h).
at::Tensor rows_times(const at::Tensor& x, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& scale,
                      const c10::optional<at::Tensor>& minimum, int64_t group,
                      const c10::optional<at::Tensor>& norm, double eps, bool glu,
                      const c10::optional<at::Tensor>& residual, bool int8_activations) {
  MatrixWeight m = matrix_weight(weight, scale, minimum, group, int8_activations);
  check_input(x);
  TORCH_CHECK(!glu || x.size(2) % 2 == 0, "a gated input has an even width");
  int64_t width = glu ? x.size(2) / 2 : x.size(2);
  TORCH_CHECK(width == m.inputs, "x has ", width, " inputs, the weight ", m.inputs);
  TORCH_CHECK(x.size(0) == m.members || x.size(0) == 1 || x.stride(0) == 0,
              "x and the weight have different stack sizes");
  const float* norm_weight = checked_norm(norm, m.members, m.inputs);
  at::Tensor y = at::empty({m.members, x.size(1), m.outputs}, x.options());
  at::Tensor added;  // the residual, its outputs contiguous
  Activations residual_rows{};
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == y.sizes() && residual->scalar_type() == at::kFloat &&
                    residual->device().is_cpu(),
                "the residual must be float32 [S, rows, outputs]");
    added = residual->stride(2) == 1 ? *residual : residual->contiguous();
    residual_rows = activations_of(added);
  }
  product_into(activations_of(x), m, norm_weight, eps, glu,
               residual.has_value() ? &residual_rows : nullptr, int8_activations,
               y.data_ptr<float>());
  return y;
}

// One layer's attention for one session's T new positions (attention.h): qkv [S, T,
// (heads + 2 kv_heads) * dim] not yet rotated; keys/values the session's cache [S, layers,
// kv_heads, capacity, dim]; cos and sin [T, dim], the rotation of positions start..
// (RotaryTable.rotation). The problem that writes the new keys and values at start.. of
// `layer`; where its attended rows go (`out`, `out_member`) is the caller's to set.
AttentionProblem attention_problem(const at::Tensor& qkv, const at::Tensor& keys_all,
                                   const at::Tensor& values_all, int64_t layer, int64_t start,
                                   const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                                   int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kFloat && qkv.stride(2) == 1,
              "qkv must be float32 [S, T, width] with contiguous rows");
  at::Tensor keys = keys_all.select(1, layer), values = values_all.select(1, layer);
  int64_t dim = keys.size(3), members = qkv.size(0), rows = qkv.size(1);
  TORCH_CHECK(keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "the cache must be float32");
  TORCH_CHECK(keys.strides() == values.strides() && keys.stride(3) == 1 &&
                  keys.stride(2) == dim && keys.size(0) == members,
              "keys and values must share a layout with contiguous positions");
  TORCH_CHECK(dim % 32 == 0 && dim <= 256, "head_dim must be a multiple of 32 up to 256");
  TORCH_CHECK(heads % kv_heads == 0 && keys.size(1) == kv_heads,
              "query heads must be a multiple of the cache's key/value heads");
  TORCH_CHECK(qkv.size(2) == (heads + 2 * kv_heads) * dim, "qkv has the wrong width");
  TORCH_CHECK(start >= 0 && start + rows <= keys.size(2), "positions beyond the cache");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.numel() == rows * dim &&
                  sin.numel() == rows * dim,
              "cos and sin must be float32 [T, head_dim]");
  return {qkv.data_ptr<float>(), members, rows, qkv.stride(0), qkv.stride(1),
          keys.data_ptr<float>(), values.data_ptr<float>(), keys.stride(0), keys.stride(1),
          cos.data_ptr<float>(), sin.data_ptr<float>(), start, heads, kv_heads, dim,
          nullptr, 0};
}

void attention(const std::vector<AttentionProblem>& problems) {
  int isa = current_isa.load();
  if (isa == kAvx512) avx512::attention(problems);
  else if (isa == kAvx2) avx2::attention(problems);
  else scalar::attention(problems);
}

// attention_problem's attention alone: returns [S, T, heads * dim].
at::Tensor attend(const at::Tensor& qkv, const at::Tensor& keys, const at::Tensor& values,
                  int64_t layer, int64_t start, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t heads, int64_t kv_heads) {
  AttentionProblem p =
      attention_problem(qkv, keys, values, layer, start, cos, sin, heads, kv_heads);
  at::Tensor out = at::empty({p.members, p.rows, heads * p.dim}, qkv.options());
  p.out = out.data_ptr<float>();
  p.out_member = p.rows * heads * p.dim;
  attention({p});
  return out;
}

// Every layer of a pre-norm decoder stack (Llama, Qwen2 without biases) over the new
// positions of one or more sessions (a ragged batch: x holds their rows one session after
// the other), in one call: what a Python loop of five calls per layer and one attention
// call per session would do, without the interpreter and the dispatcher between them.
// `weights` holds, per layer, 14 entries: the q/k/v, o, gate/up and down weights, each as
// (values, scale, minimum), then the attention and MLP norms. Per session: its cache's keys
// and values, its start, and the cos and sin of its positions (their first dimension: its
// length).
constexpr int64_t kLayerEntries = 14;

// One layer as decode_layers runs it: its weights checked, its attention's problems made.
struct DecoderLayer {
  MatrixWeight qkv, o, gate_up, down;
  const float *attention_norm, *mlp_norm;
  std::vector<AttentionProblem> problems;
};

at::Tensor decode_layers(const at::Tensor& x_given, const c10::List<std::optional<at::Tensor>>& weights,
                         int64_t group, bool int8_activations, double eps, at::TensorList keys,
                         at::TensorList values, at::IntArrayRef starts, at::TensorList cos,
                         at::TensorList sin, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(weights.size() % kLayerEntries == 0, "weights: ", kLayerEntries, " per layer");
  int64_t layers = weights.size() / kLayerEntries;
  size_t sessions = keys.size();
  TORCH_CHECK(sessions >= 1 && values.size() == sessions && starts.size() == sessions &&
                  cos.size() == sessions && sin.size() == sessions,
              "keys, values, starts, cos and sin: one of each per session");
  std::vector<int64_t> lengths(sessions);
  int64_t rows = 0;
  for (size_t i = 0; i < sessions; ++i) {
    TORCH_CHECK(keys[i].dim() == 5 && keys[i].size(1) == layers, "a cache holds ",
                keys[i].size(1), " layers, the weights ", layers);
    TORCH_CHECK(cos[i].dim() >= 1, "cos and sin must be [T, ..., head_dim] per session");
    lengths[i] = cos[i].size(0);  // (RotaryTable.rotation's [T, 1, head_dim])
    rows += lengths[i];
  }
  check_input(x_given);
  TORCH_CHECK(x_given.size(1) == rows, "x has ", x_given.size(1), " rows, the sessions ", rows);
  if (layers == 0) return x_given;

  // Every weight checked and every buffer made before the threads start: nothing may
  // throw inside their region.
  auto entry = [&](int64_t layer, int64_t index) -> std::optional<at::Tensor> {
    return weights.get(layer * kLayerEntries + index);
  };
  auto matrix = [&](int64_t layer, int64_t first) {
    std::optional<at::Tensor> weight = entry(layer, first);
    TORCH_CHECK(weight.has_value(), "a layer's weight is missing");
    return matrix_weight(*weight, entry(layer, first + 1), entry(layer, first + 2), group,
                         int8_activations);
  };
  std::vector<DecoderLayer> stack(layers);
  for (int64_t layer = 0; layer < layers; ++layer) {
    DecoderLayer& l = stack[layer];
    l.qkv = matrix(layer, 0), l.o = matrix(layer, 3), l.gate_up = matrix(layer, 6);
    l.down = matrix(layer, 9);
  }
  // The buffers are sized by the first layer's weights; every layer is checked against them.
  const int64_t hidden = x_given.size(2), width = heads * keys[0].size(4);  // an attended row
  const int64_t members = stack[0].qkv.members;
  TORCH_CHECK(x_given.size(0) == members || x_given.size(0) == 1 || x_given.stride(0) == 0,
              "x and the weights have different stack sizes");
  at::TensorOptions options = x_given.options();
  at::Tensor qkv = at::empty({members, rows, stack[0].qkv.outputs}, options);
  at::Tensor attended = at::empty({members, rows, width}, options);
  at::Tensor gate_up = at::empty({members, rows, stack[0].gate_up.outputs}, options);
  // The stream between layers: a layer's attention writes `mid` (x plus its attention),
  // its MLP `out`, which the next layer reads; x_given is never written.
  at::Tensor mid = at::empty({members, rows, hidden}, options);
  at::Tensor out = at::empty({members, rows, hidden}, options);
  for (int64_t layer = 0; layer < layers; ++layer) {
    DecoderLayer& l = stack[layer];
    for (const MatrixWeight* m : {&l.qkv, &l.o, &l.gate_up, &l.down})
      TORCH_CHECK(m->members == members, "the layers have different stack sizes");
    TORCH_CHECK(l.qkv.inputs == hidden && l.qkv.outputs == qkv.size(2) && l.o.inputs == width &&
                    l.o.outputs == hidden && l.gate_up.inputs == hidden &&
                    l.gate_up.outputs == gate_up.size(2) &&
                    l.down.inputs * 2 == gate_up.size(2) && l.down.outputs == hidden,
                "layer ", layer, "'s weights do not chain: hidden ", hidden, ", attended ", width);
    l.attention_norm = checked_norm(entry(layer, 12), members, hidden);
    l.mlp_norm = checked_norm(entry(layer, 13), members, hidden);
    int64_t offset = 0;
    for (size_t i = 0; i < sessions; ++i) {  // each session's rows: a view, no copy
      AttentionProblem p = attention_problem(qkv.narrow(1, offset, lengths[i]), keys[i], values[i],
                                             layer, starts[i], cos[i], sin[i], heads, kv_heads);
      p.out = attended.data_ptr<float>() + offset * width;  // its rows of each member
      p.out_member = rows * width;
      l.problems.push_back(p);
      offset += lengths[i];
    }
  }
  const Activations given = activations_of(x_given), attended_rows = activations_of(attended),
                    gate_up_rows = activations_of(gate_up), mid_rows = activations_of(mid),
                    out_rows = activations_of(out);
  float *qkv_out = qkv.data_ptr<float>(), *mid_out = mid.data_ptr<float>(),
        *gate_up_out = gate_up.data_ptr<float>(), *out_out = out.data_ptr<float>();
  Team team;
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
#pragma omp single
    team.size = omp_get_num_threads();  // (fewer than asked inside another region)
    seat = {&team, omp_get_thread_num()};
    for (int64_t layer = 0; layer < layers; ++layer) {
      const DecoderLayer& l = stack[layer];
      const Activations& x = layer == 0 ? given : out_rows;
      product_into(x, l.qkv, l.attention_norm, eps, false, nullptr, int8_activations, qkv_out);
      team.wait();
      attention(l.problems);
      team.wait();
      product_into(attended_rows, l.o, nullptr, eps, false, &x, int8_activations, mid_out);
      team.wait();
      product_into(mid_rows, l.gate_up, l.mlp_norm, eps, false, nullptr, int8_activations,
                   gate_up_out);
      team.wait();
      product_into(gate_up_rows, l.down, nullptr, eps, true, &mid_rows, int8_activations,
                   out_out);
      team.wait();
    }
    seat = {};
  }
  return out;
}


// --- Vocabulary-wide rows (vocabulary.h) -------------------------------------------------

// One set's row passes.
struct RowPasses {
  void (*log_softmax)(const float*, int64_t, float*);
  void (*probabilities)(const float*, int64_t, float*);
  float (*entropy)(const float*, const float*, int64_t);
  float (*margin)(const float*, int64_t);
  void (*jury_row)(const float*, int64_t, int64_t, int64_t, float, float*, int64_t*, int64_t);
  TargetRow (*target_row)(const float*, int64_t, float*, float*);
};

#define HYDRA_ROW_PASSES(set)                                                      \
  RowPasses {                                                                      \
    set::row_log_softmax, set::row_probabilities, set::row_entropy, set::row_margin, \
        set::jury_row, set::target_row                                              \
  }
const RowPasses kRowPasses[] = {HYDRA_ROW_PASSES(scalar), HYDRA_ROW_PASSES(avx2),
                                HYDRA_ROW_PASSES(avx512)};
#undef HYDRA_ROW_PASSES

// x as [rows, width]: float32 on the CPU, the last dimension the row (contiguous; a
// tensor that is not is copied).
at::Tensor as_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1, name,
              " must be a float32 CPU tensor [..., V]");
  return x.contiguous().view({-1, x.size(-1)});
}

// The shape of x without its last dimension: one value per row.
std::vector<int64_t> per_row(const at::Tensor& x) {
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - 1);
}

// fn(row) for every row, on the calling thread. Not at::parallel_for: these passes run on
// the threads beside a model thread (the single-process server's generation threads),
// which compute alone (serving.model_thread), and with it one session of `serve` ran 15%
// slower (21 against 25-28 tokens/s; 8 sessions 58 against 66), measured, the cause not
// pinned down. A round's rows are few; each takes tens of microseconds.
template <class Fn>
void for_each_row(int64_t rows, const Fn& fn) {
  for (int64_t row = 0; row < rows; ++row) fn(row);
}

using RowMap = void (*)(const float*, int64_t, float*);

// y = the set's `pass` of each row of x, shaped as x.
at::Tensor map_rows(const at::Tensor& x_given, const char* name, RowMap RowPasses::*pass) {
  at::Tensor x = as_rows(x_given, name);
  at::Tensor y = at::empty_like(x);
  RowMap fn = kRowPasses[current_isa.load()].*pass;
  int64_t width = x.size(1);
  const float* in = x.data_ptr<float>();
  float* out = y.data_ptr<float>();
  for_each_row(x.size(0), [&](int64_t r) { fn(in + r * width, width, out + r * width); });
  return y.view(x_given.sizes());
}

at::Tensor vocab_log_softmax(const at::Tensor& x) {
  return map_rows(x, "x", &RowPasses::log_softmax);
}

at::Tensor vocab_probabilities(const at::Tensor& logprobs) {
  return map_rows(logprobs, "logprobs", &RowPasses::probabilities);
}

at::Tensor vocab_entropy(const at::Tensor& probs_given, const at::Tensor& logprobs_given) {
  TORCH_CHECK(probs_given.sizes() == logprobs_given.sizes(),
              "probs and logprobs must have the same shape");
  at::Tensor probs = as_rows(probs_given, "probs"), logprobs = as_rows(logprobs_given, "logprobs");
  at::Tensor y = at::empty({probs.size(0)}, probs.options());
  const RowPasses& passes = kRowPasses[current_isa.load()];
  int64_t width = probs.size(1);
  const float *p = probs.data_ptr<float>(), *lp = logprobs.data_ptr<float>();
  float* out = y.data_ptr<float>();
  for_each_row(probs.size(0),
               [&](int64_t r) { out[r] = passes.entropy(p + r * width, lp + r * width, width); });
  return y.view(per_row(probs_given));
}

at::Tensor vocab_margin(const at::Tensor& logprobs_given) {
  at::Tensor logprobs = as_rows(logprobs_given, "logprobs");
  at::Tensor y = at::empty({logprobs.size(0)}, logprobs.options());
  const RowPasses& passes = kRowPasses[current_isa.load()];
  int64_t width = logprobs.size(1);
  const float* lp = logprobs.data_ptr<float>();
  float* out = y.data_ptr<float>();
  for_each_row(logprobs.size(0), [&](int64_t r) { out[r] = passes.margin(lp + r * width, width); });
  return y.view(per_row(logprobs_given));
}

// The jury's rows in one call: logits [J, N, V] -> (the jurors' terms summed in juror
// order [N, V], each the logits divided by `scale` (the temperature) less their maximum;
// each juror's first argmax [J, N], its vote), as PyTorch's logits / scale less their amax,
// added one juror after the other, and poe.first_argmax of the logits give them.
std::tuple<at::Tensor, at::Tensor> jury_rows(const at::Tensor& logits_given, double scale) {
  TORCH_CHECK(std::isfinite(scale) && scale > 0, "scale must be finite and > 0, got ", scale);
  TORCH_CHECK(logits_given.scalar_type() == at::kFloat && logits_given.device().is_cpu() &&
                  logits_given.dim() == 3,
              "logits must be a float32 CPU tensor [J, N, V]");
  at::Tensor logits = logits_given.contiguous();
  int64_t jurors = logits.size(0), positions = logits.size(1), width = logits.size(2);
  at::Tensor total = at::empty({positions, width}, logits.options());
  at::Tensor votes = at::empty({jurors, positions}, logits.options().dtype(at::kLong));
  const RowPasses& passes = kRowPasses[current_isa.load()];
  const float* in = logits.data_ptr<float>();
  float* out = total.data_ptr<float>();
  int64_t* vote = votes.data_ptr<int64_t>();
  for_each_row(positions, [&](int64_t n) {
    passes.jury_row(in + n * width, jurors, positions * width, width, static_cast<float>(scale),
                    out + n * width, vote + n, positions);
  });
  return {total, votes};
}

// The target's rows in one call, each pass the bits of its own op: log P (the log-product
// normalised), P, the entropy, the stability margin and the greedy token (P's first argmax).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> target_rows(
    const at::Tensor& log_product) {
  TORCH_CHECK(log_product.dim() == 2, "log_product must be [N, V]");
  at::Tensor x = as_rows(log_product, "log_product");
  int64_t rows = x.size(0), width = x.size(1);
  at::Tensor logprobs = at::empty_like(x), probs = at::empty_like(x);
  at::Tensor entropy = at::empty({rows}, x.options()), margin = at::empty({rows}, x.options());
  at::Tensor greedy = at::empty({rows}, x.options().dtype(at::kLong));
  const RowPasses& passes = kRowPasses[current_isa.load()];
  const float* in = x.data_ptr<float>();
  float *lp = logprobs.data_ptr<float>(), *p = probs.data_ptr<float>();
  float *h = entropy.data_ptr<float>(), *m = margin.data_ptr<float>();
  int64_t* g = greedy.data_ptr<int64_t>();
  for_each_row(rows, [&](int64_t r) {
    TargetRow row = passes.target_row(in + r * width, width, lp + r * width, p + r * width);
    h[r] = row.entropy;
    m[r] = row.margin;
    g[r] = row.greedy;
  });
  return {logprobs, probs, entropy, margin, greedy};
}

// One token per row by inverse CDF (poe.randomness.categorical): sums in float64 in index
// order, torch.cumsum's order, so that a row's token is the one PyTorch's path picks, bit
// for bit; the first index whose sum exceeds u times the row's total, or, where the
// threshold rounds up to the total, the last token of positive probability. One scalar
// loop for every instruction set: a sum in index order is a chain of dependent adds.
// Instead of a token: -2 for a row with a negative or non-finite value, -1 for one with
// no positive probability (the caller says which).
int64_t categorical_row(const float* p, int64_t width, double u) {
  double total = 0.0;
  bool bad = false;
  for (int64_t i = 0; i < width; ++i) {
    total += p[i];
    bad |= !(p[i] >= 0.0f) || std::isinf(p[i]);  // a NaN fails the comparison
  }
  if (bad || !std::isfinite(total)) return -2;
  if (total <= 0.0) return -1;
  double threshold = u * total, sum = 0.0;
  for (int64_t i = 0; i < width; ++i) {
    sum += p[i];
    if (sum > threshold) return i;
  }
  int64_t last = width - 1;
  while (p[last] <= 0.0f) --last;  // total > 0: some value is positive
  return last;
}

at::Tensor categorical_rows(const at::Tensor& probs_given, const at::Tensor& uniforms_given) {
  TORCH_CHECK(probs_given.dim() == 2, "probs must be [B, V]");
  at::Tensor probs = as_rows(probs_given, "probs");
  at::Tensor uniforms = uniforms_given.contiguous();
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.device().is_cpu() &&
                  uniforms.dim() == 1 && uniforms.size(0) == probs.size(0),
              "uniforms must be a float64 CPU tensor [B]");
  int64_t rows = probs.size(0), width = probs.size(1);
  at::Tensor tokens = at::empty({rows}, probs.options().dtype(at::kLong));
  const float* p = probs.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  for_each_row(rows, [&](int64_t r) { out[r] = categorical_row(p + r * width, width, u[r]); });
  return tokens;
}
}  // namespace

TORCH_LIBRARY(hydra_jury, m) {
  m.def("rows_times(Tensor x, Tensor weight, Tensor? scale, Tensor? minimum, int group, "
        "Tensor? norm, float eps, bool glu, Tensor? residual, bool int8_activations) -> Tensor",
        rows_times);
  m.def("attend(Tensor qkv, Tensor keys, Tensor values, int layer, int start, Tensor cos, "
        "Tensor sin, int heads, int kv_heads) -> Tensor",
        attend);
  m.def("decode_layers(Tensor x, Tensor?[] weights, int group, bool int8_activations, float eps, "
        "Tensor[] keys, Tensor[] values, int[] starts, Tensor[] cos, Tensor[] sin, int heads, "
        "int kv_heads) -> Tensor",
        decode_layers);
  m.def("kernel_isa(str requested) -> str", kernel_isa);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", rms_norm_rows);
  m.def("vocab_log_softmax(Tensor x) -> Tensor", vocab_log_softmax);
  m.def("vocab_probabilities(Tensor logprobs) -> Tensor", vocab_probabilities);
  m.def("vocab_entropy(Tensor probs, Tensor logprobs) -> Tensor", vocab_entropy);
  m.def("vocab_margin(Tensor logprobs) -> Tensor", vocab_margin);
  m.def("jury_rows(Tensor logits, float scale=1.0) -> (Tensor, Tensor)", jury_rows);
  m.def("target_rows(Tensor log_product) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        target_rows);
  m.def("categorical_rows(Tensor probs, Tensor uniforms) -> Tensor", categorical_rows);
}
