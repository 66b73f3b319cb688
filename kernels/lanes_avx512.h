// 32 lanes in two AVX-512 registers: lo = lanes 0-15, hi = lanes 16-31.
struct Lanes {
  __m512 lo, hi;
};

constexpr int64_t kFetchFloat32AheadFrom = 1;  // rows_times_weight.h (lanes_avx2.h: why 4 there)
// Outputs per tile of int4 weights times one row of int8 activations (rows_times_weight.h).
// On the 2-core Intel Xeon (family 6 model 207), every int4 projection of a SmolLM2 decode
// step with the output matrix, 12 alternated runs in one process, against one output at a
// time: 0.84x the time with tiles of 2, 0.80x with 3 or 4, 0.75x with 6 or 8.
constexpr int kInt4TileOutputs = 8;
// The same with 2 to 16 rows (4 rows at a time; rows_times_weight.h): every int4 projection
// of the trunk and head0, 8 alternated runs in one process, against one output at a time:
// tiles of 4 0.86x the time at 2 rows, 0.85x at 4, 0.79x at 5, 0.82x at 8, 0.80x at 16
// (tiles of 2 and 3 0.82-0.94x).
constexpr int kInt4RowsTileOutputs = 4;
// int8 weights times 2 to 16 rows, the same way: 0.88x the time at 2 rows, 0.73-0.75x at
// 4 to 16 (tiles of 2 and 3 0.75-0.88x). One row gains nothing from tiles (1 to 8 outputs
// within 0.98-1.01x, its weights' stream decides it), and keeps one output at a time.
constexpr int kInt8RowsTileOutputs = 4;

// Outputs per tile of the float products (rows_times_weight.h).
constexpr int kTileOutputs = 2;

// Part tiles (rows_times_weight.h, lanes_avx2.h): not used here, where 32 registers hold
// a tile of whole Lanes (these machines were tuned before part tiles and not remeasured).
constexpr int kParts = 2;
constexpr int kPartFloats = 16;
using Part = __m512;
constexpr int kPartTileOutputs = 1;
constexpr int64_t kPartTilesFrom = 0;

// Keeps v in registers from here on (an empty asm that reads and writes them), so that
// its loads are not folded into later instructions (rows_times_weight.h's tiles).
static inline void in_registers(Lanes& v) { __asm__("" : "+v"(v.lo), "+v"(v.hi)); }
static inline void in_registers(Part& v) { __asm__("" : "+v"(v)); }

static inline Lanes zero() { return {_mm512_setzero_ps(), _mm512_setzero_ps()}; }

static inline Lanes splat(float value) {
  __m512 v = _mm512_set1_ps(value);
  return {v, v};
}

static inline void store(float* p, Lanes v) {
  _mm512_storeu_ps(p, v.lo);
  _mm512_storeu_ps(p + 16, v.hi);
}

static inline Lanes load(const float* p) { return {_mm512_loadu_ps(p), _mm512_loadu_ps(p + 16)}; }

static inline __m512 widen16(const int8_t* p) {
  __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

static inline Lanes load_int8(const int8_t* p) { return {widen16(p), widen16(p + 16)}; }

static inline Lanes load_int4(const uint8_t* p) {
  __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i mask = _mm_set1_epi8(0x0F);
  __m128i low = _mm_and_si128(packed, mask);
  __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)),
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high))};
}

static inline Lanes fma(Lanes a, Lanes b, Lanes acc) {
  return {_mm512_fmadd_ps(a.lo, b.lo, acc.lo), _mm512_fmadd_ps(a.hi, b.hi, acc.hi)};
}

static inline Part part_zero() { return _mm512_setzero_ps(); }
static inline Part part_load(const float* p) { return _mm512_loadu_ps(p); }
static inline Part part_fma(Part a, Part b, Part acc) { return _mm512_fmadd_ps(a, b, acc); }
static inline Lanes from_parts(const Part (&p)[kParts]) { return {p[0], p[1]}; }

static inline Lanes scale_shift(Lanes q, float scale, float shift) {
  __m512 s = _mm512_set1_ps(scale), m = _mm512_set1_ps(shift);
  return {_mm512_fmadd_ps(q.lo, s, m), _mm512_fmadd_ps(q.hi, s, m)};
}

static inline float sum(Lanes v) {
  // The scalar tree: lanes i + (i + 16), then halves of 8, 4, 2 and 1.
  __m512 t16 = _mm512_add_ps(v.lo, v.hi);
  __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(t16),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t16), 1)));
  __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  __m128 t1 = _mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1));
  return _mm_cvtss_f32(t1);
}

// Lane by lane, for the vocabulary passes (lanes_scalar.h says what each computes).
static inline Lanes add(Lanes a, Lanes b) { return {_mm512_add_ps(a.lo, b.lo), _mm512_add_ps(a.hi, b.hi)}; }

static inline Lanes sub(Lanes a, Lanes b) { return {_mm512_sub_ps(a.lo, b.lo), _mm512_sub_ps(a.hi, b.hi)}; }

static inline Lanes mul(Lanes a, Lanes b) { return {_mm512_mul_ps(a.lo, b.lo), _mm512_mul_ps(a.hi, b.hi)}; }

static inline Lanes div(Lanes a, Lanes b) { return {_mm512_div_ps(a.lo, b.lo), _mm512_div_ps(a.hi, b.hi)}; }

static inline Lanes larger(Lanes a, Lanes b) { return {_mm512_max_ps(a.lo, b.lo), _mm512_max_ps(a.hi, b.hi)}; }

static inline Lanes smaller(Lanes a, Lanes b) { return {_mm512_min_ps(a.lo, b.lo), _mm512_min_ps(a.hi, b.hi)}; }

static inline Lanes above_or(Lanes x, float bound, Lanes above, Lanes otherwise) {
  __m512 b = _mm512_set1_ps(bound);
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.lo, b, _CMP_GT_OQ), otherwise.lo, above.lo),
          _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x.hi, b, _CMP_GT_OQ), otherwise.hi, above.hi)};
}

static inline Lanes without_nan(Lanes v) {
  return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v.lo, v.lo, _CMP_ORD_Q), v.lo),
          _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v.hi, v.hi, _CMP_ORD_Q), v.hi)};
}

// scalef: y * 2^k rounded once, as ldexp does.
static inline Lanes times_power_of_two(Lanes y, Lanes k) {
  return {_mm512_scalef_ps(y.lo, k.lo), _mm512_scalef_ps(y.hi, k.hi)};
}

static inline uint32_t nan_lanes(Lanes v) {
  return static_cast<uint32_t>(_mm512_cmp_ps_mask(v.lo, v.lo, _CMP_UNORD_Q)) |
         static_cast<uint32_t>(_mm512_cmp_ps_mask(v.hi, v.hi, _CMP_UNORD_Q)) << 16;
}

static inline uint32_t equal_lanes(Lanes v, float value) {
  __m512 s = _mm512_set1_ps(value);
  return static_cast<uint32_t>(_mm512_cmp_ps_mask(v.lo, s, _CMP_EQ_OQ)) |
         static_cast<uint32_t>(_mm512_cmp_ps_mask(v.hi, s, _CMP_EQ_OQ)) << 16;
}

// Integer products with int8 activations (lanes_scalar.h says what each computes): 16
// lanes in one register. VNNI's dpbusd multiplies unsigned by signed bytes and adds each
// lane's four products into int32 without saturating: int8 weights go in as (q + 128)
// times w, started from -128 times the lane's weights (computed once for every row),
// int4 weights as they are.
struct Ints16 {
  __m512i v;
};

struct Floats16 {
  __m512 v;
};

struct Int4Chunk {
  __m512i q;
};

struct Int8Chunk {
  __m512i w, bias;  // bias: -128 * the sum of each lane's 4 weights
};

static inline Int8Chunk int8_chunk(__m512i weights) {
  __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), weights);
  return {weights, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7))};
}

static inline Int8Chunk load_int8_chunk(const int8_t* w) { return int8_chunk(_mm512_loadu_si512(w)); }

// A last block of 32 inputs: a masked load reads nothing beyond it.
static inline Int8Chunk load_int8_tail(const int8_t* w) {
  return int8_chunk(_mm512_maskz_loadu_epi8(0xFFFFFFFFull, w));
}

static inline Ints16 dot_int8(const Int8Chunk& chunk, const int8_t*, const uint8_t* biased) {
  return {_mm512_dpbusd_epi32(chunk.bias, _mm512_loadu_si512(biased), chunk.w)};
}

static inline Int4Chunk unpack_int4_tail(const uint8_t* p) {
  __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i mask = _mm_set1_epi8(0x0F);
  __m128i low = _mm_and_si128(packed, mask), high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return {_mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set_m128i(high, low), 0)};
}

static inline Int4Chunk unpack_int4_chunk(const uint8_t* p) {
  // Each block's 16 bytes into two 128-bit quarters, [block 0, block 0, block 1, block 1],
  // and the second quarter of each pair shifted down to its high nibbles: input order
  // with no shuffle across the register (one fewer uop on the shuffle port).
  const __m128i* blocks = reinterpret_cast<const __m128i*>(p);
  __m512i both = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128(blocks))),
      _mm256_broadcastsi128_si256(_mm_loadu_si128(blocks + 1)), 1);
  __m512i nibbles = _mm512_mask_srli_epi16(both, 0xFF00FF00, both, 4);
  return {_mm512_and_si512(nibbles, _mm512_set1_epi8(0x0F))};
}

static inline Ints16 dot_int4(const Int4Chunk& w, const int8_t* q) {
  return {_mm512_dpbusd_epi32(_mm512_setzero_si512(), w.q, _mm512_loadu_si512(q))};
}

static inline Floats16 zero16() { return {_mm512_setzero_ps()}; }

static inline Floats16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }

// The first n (0-16) floats at p, zeros after them; nothing past them is read.
static inline Floats16 load16_first(const float* p, int64_t n) {
  return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p)};
}

static inline Floats16 pair16(float low, float high) {
  return {_mm512_insertf32x8(_mm512_set1_ps(low), _mm256_set1_ps(high), 1)};
}

static inline Floats16 to_float16(Ints16 v) { return {_mm512_cvtepi32_ps(v.v)}; }

static inline Floats16 mul16(Floats16 a, Floats16 b) { return {_mm512_mul_ps(a.v, b.v)}; }

static inline Floats16 fma16(Floats16 a, Floats16 b, Floats16 acc) {
  return {_mm512_fmadd_ps(a.v, b.v, acc.v)};
}

static inline float sum16(Floats16 v) {
  __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(v.v),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v.v), 1)));
  __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  __m128 t1 = _mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1));
  return _mm_cvtss_f32(t1);
}

// lanes_scalar.h's quantize_chunk, the same bits.
static inline void quantize_chunk(const float* x, int8_t* q, uint8_t* biased, float* step,
                                  float* sum) {
  for (int block = 0; block < 2; ++block) {
    const float* in = x + 32 * block;
    __m512 a = _mm512_loadu_ps(in), b = _mm512_loadu_ps(in + 16);
    float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
    __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
    __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));  // nearest even (MXCSR)
    __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
    qa = _mm512_max_epi32(_mm512_min_epi32(qa, high), low);
    qb = _mm512_max_epi32(_mm512_min_epi32(qb, high), low);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * block), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * block + 16), _mm512_cvtepi32_epi8(qb));
    _mm256_storeu_ps(step + 8 * block, _mm256_set1_ps(largest / 127.0f));
  }
  __m512i bytes = _mm512_loadu_si512(q);
  _mm512_storeu_si512(biased, _mm512_xor_si512(bytes, _mm512_set1_epi8(-128)));
  __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), bytes);
  _mm512_storeu_ps(sum, _mm512_cvtepi32_ps(sums));
}
