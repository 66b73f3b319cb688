// 32 lanes in four AVX2 registers: lo0 = lanes 0-7, lo1 = 8-15, hi0 = 16-23, hi1 = 24-31.
struct Lanes {
  __m256 lo0, lo1, hi0, hi1;
};

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
