// Included once per instruction set, inside that set's namespace, after its Lanes.
//
// One layer's attention for the T new positions of one session, on its cache: rotate q
// and k, store k and v at positions start.., and let each query attend to positions
// 0..its own (the causal prefix). head_dim is a multiple of 32 (at most 256).

static inline void rotate_half(const float* x, const float* cos, const float* sin, float* out,
                               int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
  }
}

static void attention(const AttentionProblem& p) {
  const int64_t dim = p.dim, half = dim / 2, blocks = dim / 32;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  for (int64_t s = 0; s < p.members; ++s)  // the new keys and values, before any query
    for (int64_t t = 0; t < p.rows; ++t)
      for (int64_t h = 0; h < p.kv_heads; ++h) {
        const float* row = p.qkv + s * p.qkv_member + t * p.qkv_row;
        int64_t at = s * p.cache_member + h * p.cache_head + (p.start + t) * dim;
        rotate_half(row + (p.heads + h) * dim, p.cos + t * dim, p.sin + t * dim, p.keys + at,
                    half);
        std::memcpy(p.values + at, row + (p.heads + p.kv_heads + h) * dim, dim * sizeof(float));
      }
  const int64_t group = p.heads / p.kv_heads;
  at::parallel_for(0, p.members * p.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(p.start + p.rows);
    alignas(64) float query[256];
    for (int64_t index = begin; index < end; ++index) {
      int64_t s = index / p.heads, head = index % p.heads;
      int64_t kv = s * p.cache_member + (head / group) * p.cache_head;
      const float *keys = p.keys + kv, *values = p.values + kv;
      for (int64_t t = 0; t < p.rows; ++t) {
        const float* row = p.qkv + s * p.qkv_member + t * p.qkv_row;
        rotate_half(row + head * dim, p.cos + t * dim, p.sin + t * dim, query, half);
        int64_t seen = p.start + t + 1;
        float largest = -INFINITY;
        for (int64_t position = 0; position < seen; ++position) {
          Lanes acc = zero();
          for (int64_t b = 0; b < blocks; ++b)
            acc = fma(load(query + b * 32), load(keys + position * dim + b * 32), acc);
          weights[position] = sum(acc) * scale;
          largest = std::max(largest, weights[position]);
        }
        float total = 0.0f;
        for (int64_t position = 0; position < seen; ++position) {
          weights[position] = std::exp(weights[position] - largest);
          total += weights[position];
        }
        Lanes out[8];
        for (int64_t b = 0; b < blocks; ++b) out[b] = zero();
        for (int64_t position = 0; position < seen; ++position) {
          Lanes weight = splat(weights[position] / total);
          for (int64_t b = 0; b < blocks; ++b)
            out[b] = fma(weight, load(values + position * dim + b * 32), out[b]);
        }
        float* destination = p.out + (s * p.rows + t) * p.heads * dim + head * dim;
        for (int64_t b = 0; b < blocks; ++b) store(destination + b * 32, out[b]);
      }
    }
  });
}
