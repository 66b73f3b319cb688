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

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

// One call: x [S, rows, inputs] (member stride x_member, 0 when every member reads the
// same rows; row stride x_row), weights [S, outputs, inputs], y [S, rows, outputs].
struct Problem {
  const float* x;
  int64_t members, rows, inputs, outputs, x_member, x_row;
  float* y;
};

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
#include "attention.h"
#include "vocabulary.h"
#include "gates.h"
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "lanes_avx2.h"
#include "rows_times_weight.h"
#include "attention.h"
#include "vocabulary.h"
#include "gates.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma")
namespace avx512 {
#include "lanes_avx512.h"
#include "rows_times_weight.h"
#include "attention.h"
#include "vocabulary.h"
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

// x as the product reads it: [S or 1, rows, inputs] float32 with unit input stride. With
// `glu`, x holds [gate, up] and the input is silu(gate) * up; with `norm` [S, inputs], the
// input is x's RMS-normalised rows times norm (one set per stack member).
at::Tensor prepared_input(const at::Tensor& x, const c10::optional<at::Tensor>& norm, double eps,
                          bool glu, int64_t members) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be a float32 CPU tensor [S, rows, inputs]");
  TORCH_CHECK(x.stride(2) == 1, "x's inputs must be contiguous");
  if (!glu && !norm.has_value()) return x;
  int64_t rows = x.size(1), inputs = glu ? x.size(2) / 2 : x.size(2);
  TORCH_CHECK(!glu || x.size(2) % 2 == 0, "a gated input has an even width");
  int64_t sources = x.size(0), outs = norm.has_value() ? members : sources;
  const float* scale = nullptr;
  if (norm.has_value()) {
    TORCH_CHECK(norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->dim() == 2 &&
                    norm->size(0) == members && norm->size(1) == inputs,
                "the norm weight must be float32 [S, inputs]");
    scale = norm->data_ptr<float>();
  }
  at::Tensor ready = at::empty({outs, rows, inputs}, x.options());
  // Vectorized: a batch of 8 sessions gates 8 rows of 1,536 inputs in each of SmolLM2's
  // layers, while the other threads wait for the product.
  int isa = current_isa.load();
  auto gate_row = isa == kAvx512 ? avx512::silu_times
                  : isa == kAvx2 ? avx2::silu_times
                                 : scalar::silu_times;
  const float* in = x.data_ptr<float>();
  float* out = ready.data_ptr<float>();
  for (int64_t s = 0; s < outs; ++s)
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = in + (sources == 1 ? 0 : s * x.stride(0)) + r * x.stride(1);
      float* target = out + (s * rows + r) * inputs;
      if (glu) {
        gate_row(row, row + inputs, inputs, target);
        row = target;
      }
      if (scale != nullptr) {
        float squares = 0.0f;
        for (int64_t k = 0; k < inputs; ++k) squares += row[k] * row[k];
        float inverse = 1.0f / std::sqrt(squares / inputs + static_cast<float>(eps));
        for (int64_t k = 0; k < inputs; ++k) target[k] = row[k] * inverse * scale[s * inputs + k];
      }
    }
  return ready;
}

// x's rows RMS-normalised and scaled by weight [S, inputs] (x [S or 1, rows, inputs]): what a
// product's `norm` does to its input, as an operator of its own, so that a norm outside a
// product (a head's final norm before a shared LM head) has the same bits as one inside.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() == 3 &&
                  (x.size(0) == weight.size(0) || x.size(0) == 1),
              "x must be [S or 1, rows, inputs] for a weight [S, inputs]");
  return prepared_input(x, weight, eps, false, weight.size(0));
}

// x's rows quantized to int8 per block of 32 inputs (quantize_chunk in lanes_*.h, the same
// bits on every set; products.py's PyTorch path computes the same d and q), into buffers
// of this thread's that later calls reuse.
QuantizedRows quantized_rows(const at::Tensor& x, int isa) {
  using Chunk = void (*)(const float*, int8_t*, uint8_t*, float*, float*);
  Chunk chunk = isa == kAvx512 ? avx512::quantize_chunk
                : isa == kAvx2 ? avx2::quantize_chunk
                               : scalar::quantize_chunk;
  bool shared = x.size(0) == 1 || x.stride(0) == 0;
  int64_t sources = shared ? 1 : x.size(0), rows = x.size(1), inputs = x.size(2);
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
  const float* in = x.data_ptr<float>();
  for (int64_t s = 0; s < sources; ++s)
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = in + s * x.stride(0) + r * x.stride(1);
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

// y = x' W^T (+ residual), x' the prepared input; the weight's format from its dtype:
// float32 [S, outputs, inputs]; int8 [S, outputs, inputs] with scale [S, outputs]; int4
// packed uint8 [S, outputs, inputs / 2] with scale and minimum [S, outputs, groups]. With
// `int8_activations` (int8 and int4 weights), x' is quantized to int8 first and the
// products are integer (rows_times_weight.h).
at::Tensor rows_times(const at::Tensor& x_given, const at::Tensor& weight,
                      const c10::optional<at::Tensor>& scale,
                      const c10::optional<at::Tensor>& minimum, int64_t group,
                      const c10::optional<at::Tensor>& norm, double eps, bool glu,
                      const c10::optional<at::Tensor>& residual, bool int8_activations) {
  TORCH_CHECK(weight.dim() == 3 && weight.is_contiguous() && weight.device().is_cpu(),
              "the weight must be a contiguous CPU tensor [S, outputs, inputs]");
  int64_t members = weight.size(0), outputs = weight.size(1);
  bool int4 = weight.scalar_type() == at::kByte;
  int64_t inputs = int4 ? weight.size(2) * 2 : weight.size(2);
  at::Tensor x = prepared_input(x_given, norm, eps, glu, members);
  TORCH_CHECK(x.size(2) == inputs, "x has ", x.size(2), " inputs, the weight ", inputs);
  TORCH_CHECK(inputs % 32 == 0, "the number of inputs must be a multiple of 32, not ", inputs);
  TORCH_CHECK(x.size(0) == members || x.size(0) == 1 || x.stride(0) == 0,
              "x and the weight have different stack sizes");
  int64_t rows = x.size(1);
  at::Tensor y = at::empty({members, rows, outputs}, x.options());
  Problem p{x.data_ptr<float>(), members, rows, inputs, outputs,
            x.size(0) == 1 ? 0 : x.stride(0), x.stride(1), y.data_ptr<float>()};
  int isa = current_isa.load();
  QuantizedRows qx{};
  if (int8_activations) {
    TORCH_CHECK(weight.scalar_type() != at::kFloat, "int8 activations need an int8 or int4 weight");
    if (isa == kAvx512 && !vnni) isa = kAvx2;
    qx = quantized_rows(x, isa);
  }
  if (weight.scalar_type() == at::kFloat) {
    const float* w = weight.data_ptr<float>();
    if (isa == kAvx512) avx512::float32(p, w);
    else if (isa == kAvx2) avx2::float32(p, w);
    else scalar::float32(p, w);
  } else if (weight.scalar_type() == at::kChar) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat &&
                    scale->is_contiguous() && scale->dim() == 2 && scale->size(0) == members &&
                    scale->size(1) == outputs,
                "an int8 weight's scale must be float32 [S, outputs]");
    const int8_t* w = weight.data_ptr<int8_t>();
    const float* s = scale->data_ptr<float>();
    if (int8_activations) {
      if (isa == kAvx512) avx512::int8_quantized_rows(p, qx, w, s);
      else if (isa == kAvx2) avx2::int8_quantized_rows(p, qx, w, s);
      else scalar::int8_quantized_rows(p, qx, w, s);
    } else if (isa == kAvx512) avx512::int8(p, w, s);
    else if (isa == kAvx2) avx2::int8(p, w, s);
    else scalar::int8(p, w, s);
  } else {
    TORCH_CHECK(int4, "the weight must be float32, int8 or packed int4 (uint8)");
    TORCH_CHECK(group > 0 && group % 32 == 0 && inputs % group == 0,
                "the group size must be a multiple of 32 that divides the inputs");
    for (const c10::optional<at::Tensor>* t : {&scale, &minimum})
      TORCH_CHECK(t->has_value() && (*t)->scalar_type() == at::kFloat && (*t)->is_contiguous() &&
                      (*t)->dim() == 3 && (*t)->size(0) == members &&
                      (*t)->size(1) == outputs && (*t)->size(2) == inputs / group,
                  "an int4 weight's scale and minimum must be float32 [S, outputs, groups]");
    const uint8_t* w = weight.data_ptr<uint8_t>();
    const float *s = scale->data_ptr<float>(), *m = minimum->data_ptr<float>();
    if (int8_activations) {
      if (isa == kAvx512) avx512::int4_quantized_rows(p, qx, w, s, m, group);
      else if (isa == kAvx2) avx2::int4_quantized_rows(p, qx, w, s, m, group);
      else scalar::int4_quantized_rows(p, qx, w, s, m, group);
    } else if (isa == kAvx512) avx512::int4(p, w, s, m, group);
    else if (isa == kAvx2) avx2::int4(p, w, s, m, group);
    else scalar::int4(p, w, s, m, group);
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == y.sizes() && residual->scalar_type() == at::kFloat,
                "the residual must be float32 [S, rows, outputs]");
    y.add_(*residual);
  }
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
  TORCH_CHECK(x_given.dim() == 3 && x_given.size(1) == rows, "x has ", x_given.size(1),
              " rows, the sessions ", rows);
  auto entry = [&](int64_t layer, int64_t index) -> std::optional<at::Tensor> {
    return weights.get(layer * kLayerEntries + index);
  };
  auto product = [&](const at::Tensor& input, int64_t layer, int64_t first,
                     const std::optional<at::Tensor>& norm, bool glu,
                     const std::optional<at::Tensor>& residual) {
    std::optional<at::Tensor> weight = entry(layer, first);
    TORCH_CHECK(weight.has_value(), "a layer's weight is missing");
    return rows_times(input, *weight, entry(layer, first + 1), entry(layer, first + 2), group,
                      norm, eps, glu, residual, int8_activations);
  };
  at::Tensor x = x_given;
  std::vector<AttentionProblem> problems(sessions);
  const int64_t width = heads * keys[0].size(4);  // an attended row
  for (int64_t layer = 0; layer < layers; ++layer) {
    at::Tensor qkv = product(x, layer, 0, entry(layer, 12), false, std::nullopt);
    at::Tensor attended = at::empty({qkv.size(0), rows, width}, qkv.options());
    int64_t offset = 0;
    for (size_t i = 0; i < sessions; ++i) {  // each session's rows: a view, no copy
      problems[i] = attention_problem(qkv.narrow(1, offset, lengths[i]), keys[i], values[i],
                                      layer, starts[i], cos[i], sin[i], heads, kv_heads);
      problems[i].out = attended.data_ptr<float>() + offset * width;  // its rows of each member
      problems[i].out_member = rows * width;
      offset += lengths[i];
    }
    attention(problems);
    x = product(attended, layer, 3, std::nullopt, false, x);
    at::Tensor gate_up = product(x, layer, 6, entry(layer, 13), false, std::nullopt);
    x = product(gate_up, layer, 9, std::nullopt, true, x);
  }
  return x;
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
