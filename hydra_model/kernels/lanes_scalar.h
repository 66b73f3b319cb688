// 32 lanes as plain floats: the reference the vector versions match bit for bit (every
// multiply-add is fused, as fmaf and the FMA instructions are).
struct Lanes {
  float f[32];
};

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

static inline Lanes scale_shift(Lanes q, float scale, float shift) {
  for (int i = 0; i < 32; ++i) q.f[i] = std::fmaf(q.f[i], scale, shift);
  return q;
}

static inline float sum(Lanes v) {
  float t[16];
  for (int i = 0; i < 16; ++i) t[i] = v.f[i] + v.f[i + 16];
  for (int width = 8; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) t[i] = t[i] + t[i + width];
  return t[0];
}
