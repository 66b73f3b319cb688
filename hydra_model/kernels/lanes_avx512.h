// 32 lanes in two AVX-512 registers: lo = lanes 0-15, hi = lanes 16-31.
struct Lanes {
  __m512 lo, hi;
};

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
