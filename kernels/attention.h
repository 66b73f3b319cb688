// Included once per instruction set, inside that set's namespace, after its Lanes and
// vocabulary.h (whose exp the softmax takes).
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
// positions; `weights` holds start + rows floats rounded up to a multiple of 32.
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
    // The softmax 32 positions at a time, with the vocabulary passes' exp (vocabulary.h):
    // std::exp one position at a time was most of a decode step's attention (SmolLM2, 100
    // positions: 11 µs a layer). The buffer's tail past `seen` is -inf, whose exp is 0.
    int64_t padded = (seen + 31) / 32 * 32;
    std::fill(weights + seen, weights + padded, -INFINITY);
    Lanes shift = splat(largest), lanes_total = zero();
    for (int64_t at = 0; at < padded; at += 32) {
      Lanes e = exp_flushed(sub(load(weights + at), shift));
      store(weights + at, e);
      lanes_total = add(lanes_total, e);
    }
    Lanes total = splat(sum(lanes_total));
    for (int64_t at = 0; at < padded; at += 32) store(weights + at, div(load(weights + at), total));
    Lanes out[8];
    for (int64_t b = 0; b < blocks; ++b) out[b] = zero();
    for (int64_t position = 0; position < seen; ++position) {
      Lanes weight = splat(weights[position]);
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
// Inside a team's region (decode_layers) its threads share the heads out in turn instead,
// and the caller waits for them before reading the result. Whichever thread computes a
// head, it computes it alone and the same way.
static void attention(const std::vector<AttentionProblem>& problems) {
  std::vector<int64_t> ends;  // cumulative heads: problem i owns [ends[i-1], ends[i])
  int64_t total = 0, longest = 0;
  for (const AttentionProblem& p : problems) {
    total += p.members * p.heads;
    ends.push_back(total);
    longest = std::max(longest, p.start + p.rows);
  }
  // Items from `next` (increasing) until it passes the last.
  auto attend_items = [&](const auto& next) {
    std::vector<float> weights((longest + 31) / 32 * 32);
    size_t i = 0;
    for (int64_t item; (item = next()) < total;) {
      while (ends[i] <= item) ++i;  // items come in order: the cursor only moves on
      attend_head(problems[i], item - (i == 0 ? 0 : ends[i - 1]), weights.data());
    }
  };
  if (seat.team != nullptr) {
    if (seat.rank == 0)
      for (const AttentionProblem& p : problems) store_new_positions(p);
    seat.team->wait();
    int64_t item = seat.rank - seat.team->size;
    attend_items([&] { return item += seat.team->size; });
    return;
  }
  for (const AttentionProblem& p : problems) store_new_positions(p);
  std::atomic<int64_t> next{0};
  // One task per thread (one alone runs on this thread), each taking heads until none is left.
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), total), 1, [&](int64_t, int64_t) {
    attend_items([&] { return next.fetch_add(1, std::memory_order_relaxed); });
  });
}
