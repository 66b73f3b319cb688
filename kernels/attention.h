// Included once per instruction set, inside that set's namespace, after its Lanes.
//
// One layer's attention for the T new positions of each of one or more sessions, on their
// caches: rotate q and k, store k and v at positions start.., and let each query attend to
// positions 0..its own (the causal prefix). head_dim is a multiple of 32 (at most 256).

static inline void rotate_half(const float* x, const float* cos, const float* sin, float* out,
                               int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
  }
}

// Writes the session's new keys (rotated) and values at positions start.., before any
// query reads them.
static void store_new_positions(const AttentionProblem& p) {
  const int64_t dim = p.dim, half = dim / 2;
  for (int64_t s = 0; s < p.members; ++s)
    for (int64_t t = 0; t < p.rows; ++t)
      for (int64_t h = 0; h < p.kv_heads; ++h) {
        const float* row = p.qkv + s * p.qkv_member + t * p.qkv_row;
        int64_t at = s * p.cache_member + h * p.cache_head + (p.start + t) * dim;
        rotate_half(row + (p.heads + h) * dim, p.cos + t * dim, p.sin + t * dim, p.keys + at,
                    half);
        std::memcpy(p.values + at, row + (p.heads + p.kv_heads + h) * dim, dim * sizeof(float));
      }
}

// One query head of one stack member (index = member * heads + head) over its new
// positions; `weights` holds start + rows floats.
static void attend_head(const AttentionProblem& p, int64_t index, float* weights) {
  const int64_t dim = p.dim, half = dim / 2, blocks = dim / 32;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const int64_t group = p.heads / p.kv_heads;
  alignas(64) float query[256];
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
    float* destination = p.out + s * p.out_member + t * p.heads * dim + head * dim;
    for (int64_t b = 0; b < blocks; ++b) store(destination + b * 32, out[b]);
  }
}

// The attention of several sessions (a ragged batch's) in one parallel region: every
// session's new keys and values first, then each (session, member, head) as a thread
// comes to it. One region rather than one per session: a batch of 8 sessions would
// otherwise wake and wait for the threads 8 times a layer, with 9 heads split 5 and 4.
// Whichever thread computes a head, it computes it alone and the same way.
static void attention(const std::vector<AttentionProblem>& problems) {
  std::vector<int64_t> ends;  // cumulative heads: problem i owns [ends[i-1], ends[i])
  int64_t total = 0, longest = 0;
  for (const AttentionProblem& p : problems) {
    store_new_positions(p);
    total += p.members * p.heads;
    ends.push_back(total);
    longest = std::max(longest, p.start + p.rows);
  }
  std::atomic<int64_t> next{0};
  auto work = [&](int64_t, int64_t) {
    std::vector<float> weights(longest);
    size_t i = 0;
    for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      while (ends[i] <= item) ++i;  // items are taken in order: the cursor only moves on
      attend_head(problems[i], item - (i == 0 ? 0 : ends[i - 1]), weights.data());
    }
  };
  // One task per thread (one alone runs on this thread), each taking heads until none is left.
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), total), 1, work);
}
