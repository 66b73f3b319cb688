// 32 lanes as plain floats: the reference the vector versions match bit for bit (every
// multiply-add is fused, as fmaf and the FMA instructions are).
struct Lanes {
  float f[32];
};

constexpr int64_t kFetchFloat32AheadFrom = 1;  // rows_times_weight.h (lanes_avx2.h: why 4 there)
constexpr int kInt4TileOutputs = 1;  // rows_times_weight.h (lanes_avx2.h: why two there)
constexpr int kInt4RowsTileOutputs = 1;
constexpr int kInt8RowsTileOutputs = 1;

// Outputs per tile of the float products (rows_times_weight.h).
constexpr int kTileOutputs = 1;

// Part tiles (rows_times_weight.h, lanes_avx2.h): not here; one part is the whole Lanes.
constexpr int kParts = 1;
constexpr int kPartFloats = 32;
using Part = Lanes;
constexpr int kPartTileOutputs = 1;
constexpr int64_t kPartTilesFrom = 0;

// Nothing to keep: scalar code has no loads to fold (rows_times_weight.h's tiles).
static inline void in_registers(Lanes&) {}

static inline Lanes zero() {
  Lanes v;
  for (int i = 0; i < 32; ++i) v.f[i] = 0.0f;
  return v;
}

static inline Lanes splat(float value) {
  Lanes v;
  for (int i = 0; i < 32; ++i) v.f[i] = value;
  return v;
}

static inline void store(float* p, Lanes v) {
  for (int i = 0; i < 32; ++i) p[i] = v.f[i];
}

static inline Lanes load(const float* p) {
  Lanes v;
  for (int i = 0; i < 32; ++i) v.f[i] = p[i];
  return v;
}

static inline Lanes load_int8(const int8_t* p) {
  Lanes v;
  for (int i = 0; i < 32; ++i) v.f[i] = static_cast<float>(p[i]);
  return v;
}

// 16 bytes: lane i < 16 is the low nibble of byte i, lane 16 + i its high nibble.
static inline Lanes load_int4(const uint8_t* p) {
  Lanes v;
  for (int i = 0; i < 16; ++i) {
    v.f[i] = static_cast<float>(p[i] & 0x0F);
    v.f[16 + i] = static_cast<float>(p[i] >> 4);
  }
  return v;
}

static inline Lanes fma(Lanes a, Lanes b, Lanes acc) {
  for (int i = 0; i < 32; ++i) acc.f[i] = std::fmaf(a.f[i], b.f[i], acc.f[i]);
  return acc;
}

static inline Part part_zero() { return zero(); }
static inline Part part_load(const float* p) { return load(p); }
static inline Part part_fma(Part a, Part b, Part acc) { return fma(a, b, acc); }
static inline Lanes from_parts(const Part (&p)[kParts]) { return p[0]; }

static inline Lanes scale_shift(Lanes q, float scale, float shift) {
  for (int i = 0; i < 32; ++i) q.f[i] = std::fmaf(q.f[i], scale, shift);
  return q;
}

// Lanes i + (i + kLanes / 2), then halves down to one: the order every set sums in.
template <int kLanes>
static inline float tree_sum(const float* v) {
  float t[kLanes / 2];
  for (int i = 0; i < kLanes / 2; ++i) t[i] = v[i] + v[i + kLanes / 2];
  for (int width = kLanes / 4; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) t[i] = t[i] + t[i + width];
  return t[0];
}

static inline float sum(Lanes v) { return tree_sum<32>(v.f); }

// Lane by lane, for the vocabulary passes (vocabulary.h). larger/smaller take b where
// the comparison fails (a NaN, or equal values), as the vector max and min do.
static inline Lanes add(Lanes a, Lanes b) {
  for (int i = 0; i < 32; ++i) a.f[i] = a.f[i] + b.f[i];
  return a;
}

static inline Lanes sub(Lanes a, Lanes b) {
  for (int i = 0; i < 32; ++i) a.f[i] = a.f[i] - b.f[i];
  return a;
}

static inline Lanes mul(Lanes a, Lanes b) {
  for (int i = 0; i < 32; ++i) a.f[i] = a.f[i] * b.f[i];
  return a;
}

static inline Lanes div(Lanes a, Lanes b) {
  for (int i = 0; i < 32; ++i) a.f[i] = a.f[i] / b.f[i];
  return a;
}

static inline Lanes larger(Lanes a, Lanes b) {
  for (int i = 0; i < 32; ++i) a.f[i] = a.f[i] > b.f[i] ? a.f[i] : b.f[i];
  return a;
}

static inline Lanes smaller(Lanes a, Lanes b) {
  for (int i = 0; i < 32; ++i) a.f[i] = a.f[i] < b.f[i] ? a.f[i] : b.f[i];
  return a;
}

// Lanes of x above `bound` take `above`'s value, the others (NaN among them) `otherwise`'s.
static inline Lanes above_or(Lanes x, float bound, Lanes above, Lanes otherwise) {
  for (int i = 0; i < 32; ++i) otherwise.f[i] = x.f[i] > bound ? above.f[i] : otherwise.f[i];
  return otherwise;
}

// y * 2^k for whole numbers k in [-126, 128], rounded once (where the result is subnormal).
static inline Lanes times_power_of_two(Lanes y, Lanes k) {
  for (int i = 0; i < 32; ++i) y.f[i] = std::ldexp(y.f[i], static_cast<int>(k.f[i]));
  return y;
}

// NaN lanes as 0.
static inline Lanes without_nan(Lanes v) {
  for (int i = 0; i < 32; ++i) v.f[i] = v.f[i] == v.f[i] ? v.f[i] : 0.0f;
  return v;
}

// Bit i set where lane i is NaN / equals `value`.
static inline uint32_t nan_lanes(Lanes v) {
  uint32_t mask = 0;
  for (int i = 0; i < 32; ++i) mask |= static_cast<uint32_t>(v.f[i] != v.f[i]) << i;
  return mask;
}

static inline uint32_t equal_lanes(Lanes v, float value) {
  uint32_t mask = 0;
  for (int i = 0; i < 32; ++i) mask |= static_cast<uint32_t>(v.f[i] == value) << i;
  return mask;
}

// Integer products with int8 activations (rows_times_weight.h, "Quantized activations"):
// 16 lanes over a chunk of 64 inputs, lane l holding inputs 4l..4l+3. Integer lane sums
// are exact, so every set computes the same integers; the float steps below are the
// reference the vector versions match.
struct Ints16 {
  int32_t i[16];
};

struct Floats16 {
  float f[16];
};

// A chunk of 64 int4 weights unpacked to one byte each, in input order.
struct Int4Chunk {
  uint8_t q[64];
};

// A chunk of 64 int8 weights (a last block of 32 alone: the second block zero).
struct Int8Chunk {
  int8_t w[64];
};

static inline Int8Chunk load_int8_chunk(const int8_t* w) {
  Int8Chunk c;
  std::memcpy(c.w, w, 64);
  return c;
}

static inline Int8Chunk load_int8_tail(const int8_t* w) {
  Int8Chunk c = {};
  std::memcpy(c.w, w, 32);
  return c;
}

// Per lane of 16, the sum over its 4 inputs of w * q: 64 weights (int8, or int4 values
// unpacked to bytes) against 64 quantized activations.
template <class W>
static inline Ints16 lane_dots(const W* w, const int8_t* q) {
  Ints16 v;
  for (int l = 0; l < 16; ++l) {
    int32_t total = 0;
    for (int j = 0; j < 4; ++j) total += int32_t(w[4 * l + j]) * int32_t(q[4 * l + j]);
    v.i[l] = total;
  }
  return v;
}

// An int8 chunk's lane sums (`biased`, q + 128, is for the vector versions).
static inline Ints16 dot_int8(const Int8Chunk& chunk, const int8_t* q, const uint8_t*) {
  return lane_dots(chunk.w, q);
}

// Two blocks of 32 packed int4 weights (16 bytes each: byte j holds input j in its low
// nibble and input j + 16 in its high one).
static inline Int4Chunk unpack_int4_chunk(const uint8_t* p) {
  Int4Chunk c;
  for (int block = 0; block < 2; ++block)
    for (int j = 0; j < 16; ++j) {
      c.q[32 * block + j] = p[16 * block + j] & 0x0F;
      c.q[32 * block + 16 + j] = p[16 * block + j] >> 4;
    }
  return c;
}

// One last block of 16 packed bytes: the second block's weights read as zero.
static inline Int4Chunk unpack_int4_tail(const uint8_t* p) {
  uint8_t padded[32] = {};
  std::memcpy(padded, p, 16);
  return unpack_int4_chunk(padded);
}

static inline Ints16 dot_int4(const Int4Chunk& w, const int8_t* q) { return lane_dots(w.q, q); }

static inline Floats16 zero16() { return Floats16{}; }

static inline Floats16 load16(const float* p) {
  Floats16 v;
  for (int l = 0; l < 16; ++l) v.f[l] = p[l];
  return v;
}

// The first n (0-16) floats at p, zeros after them; nothing past them is read.
static inline Floats16 load16_first(const float* p, int64_t n) {
  Floats16 v = {};
  for (int64_t l = 0; l < n; ++l) v.f[l] = p[l];
  return v;
}

// Lanes 0-7 `low`, lanes 8-15 `high`: one value per block of 32 inputs.
static inline Floats16 pair16(float low, float high) {
  Floats16 v;
  for (int l = 0; l < 16; ++l) v.f[l] = l < 8 ? low : high;
  return v;
}

static inline Floats16 to_float16(Ints16 v) {
  Floats16 f;
  for (int l = 0; l < 16; ++l) f.f[l] = static_cast<float>(v.i[l]);
  return f;
}

static inline Floats16 mul16(Floats16 a, Floats16 b) {
  for (int l = 0; l < 16; ++l) a.f[l] = a.f[l] * b.f[l];
  return a;
}

static inline Floats16 fma16(Floats16 a, Floats16 b, Floats16 acc) {
  for (int l = 0; l < 16; ++l) acc.f[l] = std::fmaf(a.f[l], b.f[l], acc.f[l]);
  return acc;
}

static inline float sum16(Floats16 v) { return tree_sum<16>(v.f); }

// 64 activations quantized to int8, a step per block of 32 (QuantizedRows, kernels.cpp):
// q = round(x * (127 / max|x|)) to nearest even, d = max|x| / 127, and q + 128 as a
// byte; per lane of 4 inputs, its block's d and the float sum of its q.
static inline void quantize_chunk(const float* x, int8_t* q, uint8_t* biased, float* step,
                                  float* sum) {
  for (int block = 0; block < 2; ++block) {
    const float* in = x + 32 * block;
    float largest = 0.0f;
    for (int k = 0; k < 32; ++k) largest = std::max(largest, std::fabs(in[k]));
    float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
    for (int k = 0; k < 32; ++k) {
      float rounded = std::nearbyint(in[k] * inverse);
      q[32 * block + k] = static_cast<int8_t>(std::fmin(std::fmax(rounded, -127.0f), 127.0f));
    }
    for (int l = 0; l < 8; ++l) step[8 * block + l] = largest / 127.0f;
  }
  for (int k = 0; k < 64; ++k) biased[k] = static_cast<uint8_t>(q[k] + 128);
  for (int l = 0; l < 16; ++l)
    sum[l] = static_cast<float>(q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
}
