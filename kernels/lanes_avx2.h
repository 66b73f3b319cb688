// 32 lanes in four AVX2 registers: lo0 = lanes 0-7, lo1 = 8-15, hi0 = 16-23, hi1 = 24-31.
struct Lanes {
  __m256 lo0, lo1, hi0, hi1;
};

// Outputs per tile of the float products (rows_times_weight.h).
constexpr int kTileOutputs = 1;

// From how many rows of activations a whole-Lanes tile fetches float32 weights ahead in
// software (rows_times_weight.h; from 8 rows the part tiles fetch the next tile's). One
// row does not: on a 2-core AMD EPYC (Zen 3, AVX2 only) the hardware prefetcher streams
// them faster alone. Every projection of SmolLM2's trunk and a head, paired in one
// process: 0.86x the time without, 0.87x fetching 512 bytes ahead; decoding 0.91x the
// time a token. Nor do two or three rows (1.08-1.17x the time fetching ahead: every
// projection of the trunk and the LM head, 7 pairs in one process, the rule switched
// between calls). Four rows and more do: with four multiply-adds for each weight loaded,
// the core keeps fewer weights in flight than the stream needs. 4 rows 0.82-0.85x the
// time, 5 to 7 rows 0.87-0.92x, fetching 2, 4, 8 or 16 KB ahead alike; in-process
// decoding with the 4-head jury (whose LM head multiplies 4 rows a step) 1.04x the
// tokens/s non-speculative, 1.02x at γ = 4, 7 pairs each, the tokens identical.
// Quantized weights gain from it at one row (int8 1.13x the time without), and the
// AVX-512 machines were tuned with it at every row count.
constexpr int64_t kFetchFloat32AheadFrom = 4;

// Outputs per tile of int4 weights times one row of int8 activations (rows_times_weight.h).
// Two here: on the Zen 3 EPYC, SmolLM2's int4 projections took 0.73x the time of one
// output at a time (0.70-0.75, 25 pairs in one process, with a first version switched by
// an environment variable; 0.61x with a 12,288 x 576 weight in the caches), and decoding
// ran 1.1-1.5x the tokens/s in four pairs of runs. Two int8 outputs a tile were slower
// there (decoding 0.7-0.9x), so int8 keeps one. The AVX-512 machines were not measured
// and keep one, as they were tuned.
constexpr int kInt4TileOutputs = 2;
// With more rows, one output at a time: two outputs times four rows would need eight
// accumulators of two registers each, all sixteen (not measured).
constexpr int kInt4RowsTileOutputs = 1;
constexpr int kInt8RowsTileOutputs = 1;  // the same

// A Lanes is four registers ("parts" of 8 lanes). With many rows the float products run
// one part at a time over a weight row (rows_times_weight.h's part tiles): a row's
// accumulator is then one register, not four, and a tile of 3 outputs times 4 rows keeps
// its 12 accumulators, 3 weights and an activation in the 16 registers AVX2 has. A tile of
// whole Lanes, one output times 4 rows, needs 16 accumulators alone and spills. On the
// 2-core AMD EPYC (Zen 3), in one process, the path switched between calls (medians of
// the time ratios of 7-15 pairs): every projection of SmolLM2's trunk and head0 0.84x the
// time at 8 rows, 0.77x at 16; its 49,152 x 576 LM head 0.76x at 8 rows, 0.70x at 16,
// 0.59x at 32. At 5 to 7 rows the pairs disagreed from run to run (0.87-1.20x), hence
// from 8 rows. A C loop of the two tiles on one core, weights in the L2 cache: 36 billion
// multiply-adds a second against 14.6.
constexpr int kParts = 4;
constexpr int kPartFloats = 8;
using Part = __m256;
constexpr int kPartTileOutputs = 3;
constexpr int64_t kPartTilesFrom = 8;

static inline Part part_zero() { return _mm256_setzero_ps(); }
static inline Part part_load(const float* p) { return _mm256_loadu_ps(p); }
static inline Part part_fma(Part a, Part b, Part acc) { return _mm256_fmadd_ps(a, b, acc); }
static inline Lanes from_parts(const Part (&p)[kParts]) { return {p[0], p[1], p[2], p[3]}; }

// Keeps v in registers from here on (an empty asm that reads and writes them), so that
// its loads are not folded into later instructions (rows_times_weight.h's tiles).
static inline void in_registers(Lanes& v) {
  __asm__("" : "+x"(v.lo0), "+x"(v.lo1), "+x"(v.hi0), "+x"(v.hi1));
}
static inline void in_registers(Part& v) { __asm__("" : "+x"(v)); }

static inline Lanes zero() {
  __m256 z = _mm256_setzero_ps();
  return {z, z, z, z};
}

static inline Lanes splat(float value) {
  __m256 v = _mm256_set1_ps(value);
  return {v, v, v, v};
}

static inline void store(float* p, Lanes v) {
  _mm256_storeu_ps(p, v.lo0);
  _mm256_storeu_ps(p + 8, v.lo1);
  _mm256_storeu_ps(p + 16, v.hi0);
  _mm256_storeu_ps(p + 24, v.hi1);
}

static inline Lanes load(const float* p) {
  return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8), _mm256_loadu_ps(p + 16),
          _mm256_loadu_ps(p + 24)};
}

static inline __m256 widen8(const int8_t* p) {
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

static inline Lanes load_int8(const int8_t* p) {
  return {widen8(p), widen8(p + 8), widen8(p + 16), widen8(p + 24)};
}

static inline __m256 widen_u8(__m128i bytes) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

static inline Lanes load_int4(const uint8_t* p) {
  __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i mask = _mm_set1_epi8(0x0F);
  __m128i low = _mm_and_si128(packed, mask);
  __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return {widen_u8(low), widen_u8(_mm_srli_si128(low, 8)), widen_u8(high),
          widen_u8(_mm_srli_si128(high, 8))};
}

static inline Lanes fma(Lanes a, Lanes b, Lanes acc) {
  return {_mm256_fmadd_ps(a.lo0, b.lo0, acc.lo0), _mm256_fmadd_ps(a.lo1, b.lo1, acc.lo1),
          _mm256_fmadd_ps(a.hi0, b.hi0, acc.hi0), _mm256_fmadd_ps(a.hi1, b.hi1, acc.hi1)};
}

static inline Lanes scale_shift(Lanes q, float scale, float shift) {
  __m256 s = _mm256_set1_ps(scale), m = _mm256_set1_ps(shift);
  return {_mm256_fmadd_ps(q.lo0, s, m), _mm256_fmadd_ps(q.lo1, s, m),
          _mm256_fmadd_ps(q.hi0, s, m), _mm256_fmadd_ps(q.hi1, s, m)};
}

static inline float sum(Lanes v) {
  // The scalar tree: lanes i + (i + 16), then halves of 8, 4, 2 and 1.
  __m256 t8 = _mm256_add_ps(_mm256_add_ps(v.lo0, v.hi0), _mm256_add_ps(v.lo1, v.hi1));
  __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  __m128 t1 = _mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1));
  return _mm_cvtss_f32(t1);
}

// Lane by lane, for the vocabulary passes (lanes_scalar.h says what each computes).
template <class Op>
static inline Lanes each(Lanes a, Lanes b, Op op) {
  return {op(a.lo0, b.lo0), op(a.lo1, b.lo1), op(a.hi0, b.hi0), op(a.hi1, b.hi1)};
}

static inline Lanes add(Lanes a, Lanes b) { return each(a, b, [](__m256 x, __m256 y) { return _mm256_add_ps(x, y); }); }

static inline Lanes sub(Lanes a, Lanes b) { return each(a, b, [](__m256 x, __m256 y) { return _mm256_sub_ps(x, y); }); }

static inline Lanes mul(Lanes a, Lanes b) { return each(a, b, [](__m256 x, __m256 y) { return _mm256_mul_ps(x, y); }); }

static inline Lanes div(Lanes a, Lanes b) { return each(a, b, [](__m256 x, __m256 y) { return _mm256_div_ps(x, y); }); }

static inline Lanes larger(Lanes a, Lanes b) { return each(a, b, [](__m256 x, __m256 y) { return _mm256_max_ps(x, y); }); }

static inline Lanes smaller(Lanes a, Lanes b) { return each(a, b, [](__m256 x, __m256 y) { return _mm256_min_ps(x, y); }); }

static inline Lanes above_or(Lanes x, float bound, Lanes above, Lanes otherwise) {
  __m256 b = _mm256_set1_ps(bound);
  auto pick = [b](__m256 v, __m256 yes, __m256 no) {
    return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(v, b, _CMP_GT_OQ));
  };
  return {pick(x.lo0, above.lo0, otherwise.lo0), pick(x.lo1, above.lo1, otherwise.lo1),
          pick(x.hi0, above.hi0, otherwise.hi0), pick(x.hi1, above.hi1, otherwise.hi1)};
}

// 2^k of whole numbers k in [-126, 127], from the exponent's bits.
static inline __m256 power_of_two8(__m256 k) {
  __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23));
}

static inline Lanes power_of_two(Lanes k) {
  return {power_of_two8(k.lo0), power_of_two8(k.lo1), power_of_two8(k.hi0), power_of_two8(k.hi1)};
}

// 2^k in two factors that are normal numbers: y * 2^half is exact, the second product
// rounds once, as ldexp does.
static inline Lanes times_power_of_two(Lanes y, Lanes k) {
  const Lanes magic = splat(12582912.0f);  // (a nearest whole number: vocabulary.h)
  Lanes half = sub(add(mul(k, splat(0.5f)), magic), magic);
  return mul(mul(y, power_of_two(half)), power_of_two(sub(k, half)));
}

static inline Lanes without_nan(Lanes v) {
  auto keep = [](__m256 x) { return _mm256_and_ps(x, _mm256_cmp_ps(x, x, _CMP_ORD_Q)); };
  return {keep(v.lo0), keep(v.lo1), keep(v.hi0), keep(v.hi1)};
}

static inline uint32_t lane_bits(__m256 a, __m256 b, __m256 c, __m256 d) {
  return static_cast<uint32_t>(_mm256_movemask_ps(a)) |
         static_cast<uint32_t>(_mm256_movemask_ps(b)) << 8 |
         static_cast<uint32_t>(_mm256_movemask_ps(c)) << 16 |
         static_cast<uint32_t>(_mm256_movemask_ps(d)) << 24;
}

static inline uint32_t nan_lanes(Lanes v) {
  return lane_bits(_mm256_cmp_ps(v.lo0, v.lo0, _CMP_UNORD_Q), _mm256_cmp_ps(v.lo1, v.lo1, _CMP_UNORD_Q),
                   _mm256_cmp_ps(v.hi0, v.hi0, _CMP_UNORD_Q), _mm256_cmp_ps(v.hi1, v.hi1, _CMP_UNORD_Q));
}

static inline uint32_t equal_lanes(Lanes v, float value) {
  __m256 s = _mm256_set1_ps(value);
  return lane_bits(_mm256_cmp_ps(v.lo0, s, _CMP_EQ_OQ), _mm256_cmp_ps(v.lo1, s, _CMP_EQ_OQ),
                   _mm256_cmp_ps(v.hi0, s, _CMP_EQ_OQ), _mm256_cmp_ps(v.hi1, s, _CMP_EQ_OQ));
}

// Integer products with int8 activations (lanes_scalar.h says what each computes): 16
// lanes as two registers of 8. maddubs multiplies unsigned by signed bytes and adds
// pairs into int16, which saturates beyond 32767: int8 weights go in as |q| times w with
// q's sign (127 * 127 * 2 fits), int4 weights as they are (15 * 127 * 2 fits).
struct Ints16 {
  __m256i lo, hi;
};

struct Floats16 {
  __m256 lo, hi;
};

struct Int4Chunk {
  __m256i lo, hi;  // inputs 0-31 and 32-63
};

static inline __m256i pairs_to_lanes(__m256i pairs) {
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

struct Int8Chunk {
  __m256i lo, hi;
};

static inline Int8Chunk load_int8_chunk(const int8_t* w) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32))};
}

static inline Int8Chunk load_int8_tail(const int8_t* w) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), _mm256_setzero_si256()};
}

static inline __m256i dot_int8_32(__m256i weights, const int8_t* q) {
  __m256i acts = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  return pairs_to_lanes(
      _mm256_maddubs_epi16(_mm256_abs_epi8(acts), _mm256_sign_epi8(weights, acts)));
}

static inline Ints16 dot_int8(const Int8Chunk& chunk, const int8_t* q, const uint8_t*) {
  return {dot_int8_32(chunk.lo, q), dot_int8_32(chunk.hi, q + 32)};
}

static inline Int4Chunk unpack_int4_chunk(const uint8_t* p) {
  __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m256i mask = _mm256_set1_epi8(0x0F);
  __m256i low = _mm256_and_si256(packed, mask);  // [block 0: 0-15 | block 1: 0-15]
  __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);  // inputs 16-31
  return {_mm256_permute2x128_si256(low, high, 0x20), _mm256_permute2x128_si256(low, high, 0x31)};
}

static inline Int4Chunk unpack_int4_tail(const uint8_t* p) {
  __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i mask = _mm_set1_epi8(0x0F);
  __m128i low = _mm_and_si128(packed, mask), high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  return {_mm256_set_m128i(high, low), _mm256_setzero_si256()};
}

static inline Ints16 dot_int4(const Int4Chunk& w, const int8_t* q) {
  __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
  return {pairs_to_lanes(_mm256_maddubs_epi16(w.lo, q0)),
          pairs_to_lanes(_mm256_maddubs_epi16(w.hi, q1))};
}

static inline Floats16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }

static inline Floats16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }

// The first n (0-16) floats at p, zeros after them; nothing past them is read.
static inline Floats16 load16_first(const float* p, int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i low = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane);
  __m256i high = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n) - 8), lane);
  return {_mm256_maskload_ps(p, low), _mm256_maskload_ps(p + 8, high)};
}

static inline Floats16 pair16(float low, float high) {
  return {_mm256_set1_ps(low), _mm256_set1_ps(high)};
}

static inline Floats16 to_float16(Ints16 v) {
  return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)};
}

static inline Floats16 mul16(Floats16 a, Floats16 b) {
  return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
}

static inline Floats16 fma16(Floats16 a, Floats16 b, Floats16 acc) {
  return {_mm256_fmadd_ps(a.lo, b.lo, acc.lo), _mm256_fmadd_ps(a.hi, b.hi, acc.hi)};
}

static inline float sum16(Floats16 v) {
  __m256 t8 = _mm256_add_ps(v.lo, v.hi);
  __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  __m128 t1 = _mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1));
  return _mm_cvtss_f32(t1);
}

static inline float largest_magnitude(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 magnitude = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(magnitude, a), _mm256_andnot_ps(magnitude, b)),
                           _mm256_max_ps(_mm256_andnot_ps(magnitude, c), _mm256_andnot_ps(magnitude, d)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
}

static inline __m256i clamped(__m256 x, __m256 inverse) {
  __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(x, inverse));  // nearest even (MXCSR)
  return _mm256_max_epi32(_mm256_min_epi32(q, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
}

// lanes_scalar.h's quantize_chunk, the same bits.
static inline void quantize_chunk(const float* x, int8_t* q, uint8_t* biased, float* step,
                                  float* sum) {
  for (int block = 0; block < 2; ++block) {
    const float* in = x + 32 * block;
    __m256 a = _mm256_loadu_ps(in), b = _mm256_loadu_ps(in + 8), c = _mm256_loadu_ps(in + 16),
           d = _mm256_loadu_ps(in + 24);
    float largest = largest_magnitude(a, b, c, d);
    __m256 inverse = _mm256_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
    // packs interleaves 128-bit halves; the permutation puts the 32 bytes back in order.
    __m256i words = _mm256_packs_epi32(clamped(a, inverse), clamped(b, inverse));
    __m256i words2 = _mm256_packs_epi32(clamped(c, inverse), clamped(d, inverse));
    __m256i bytes = _mm256_packs_epi16(words, words2);
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 32 * block), bytes);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(biased + 32 * block),
                        _mm256_xor_si256(bytes, _mm256_set1_epi8(-128)));
    _mm256_storeu_ps(step + 8 * block, _mm256_set1_ps(largest / 127.0f));
    __m256i ones = _mm256_set1_epi8(1);
    _mm256_storeu_ps(sum + 8 * block,
                     _mm256_cvtepi32_ps(pairs_to_lanes(_mm256_maddubs_epi16(ones, bytes))));
  }
}
