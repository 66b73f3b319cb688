// Included once per instruction set, inside that set's namespace, after its Lanes.
//
// Passes over vocabulary-wide rows: the decoding loop's distributions (poe/target.py,
// poe/metrics.py). A row is read 32 lanes at a time; a last chunk shorter than that reads
// the missing lanes as -inf (whose exp is 0) unless it says otherwise. Every sum accumulates lane by lane in chunk
// order and ends in the lanes' tree (`sum`), every maximum is exact, and the exp is this
// file's own rather than the C library's or PyTorch's: so each set gives the bits of the
// scalar reference, whatever the CPU.

// ln of float32's smallest normal number and of its largest number. The exp reads
// anything at or below the first as 0 (poe.probabilities explains why) and anything above
// the second as +inf.
constexpr float kLowestExp = -87.33654475f;
constexpr float kHighestExp = 88.72283906f;

static inline Lanes load_chunk(const float* x, int64_t at, int64_t width,
                               float padding = -INFINITY) {
  if (at + 32 <= width) return load(x + at);
  alignas(64) float tail[32];
  for (int64_t i = 0; i < 32; ++i) tail[i] = at + i < width ? x[at + i] : padding;
  return load(tail);
}

static inline void store_chunk(float* y, int64_t at, int64_t width, Lanes v) {
  if (at + 32 <= width) {
    store(y + at, v);
    return;
  }
  alignas(64) float tail[32];
  store(tail, v);
  for (int64_t i = 0; at + i < width; ++i) y[at + i] = tail[i];
}

// The nearest whole number (ties to even) of |v| < 2^22: adding 1.5 * 2^23 leaves no
// fraction bits, and the rounding is the addition's own.
static inline Lanes nearest_whole(Lanes v) {
  const Lanes magic = splat(12582912.0f);
  return sub(add(v, magic), magic);
}

// exp(x) within about an ulp: x = k ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts, so
// that k ln 2 is exact to float's precision), e^r by Cephes' degree-5 polynomial (Moshier,
// Cephes Math Library), times 2^k in two factors so that each stays a normal number.
static inline Lanes exp_flushed(Lanes x) {
  Lanes t = smaller(larger(x, splat(kLowestExp)), splat(kHighestExp));
  Lanes k = nearest_whole(mul(t, splat(1.44269504088896341f)));
  Lanes r = fma(k, splat(-0.693359375f), t);
  r = fma(k, splat(2.12194440e-4f), r);
  Lanes y = splat(1.9875691500e-4f);
  y = fma(y, r, splat(1.3981999507e-3f));
  y = fma(y, r, splat(8.3334519073e-3f));
  y = fma(y, r, splat(4.1665795894e-2f));
  y = fma(y, r, splat(1.6666665459e-1f));
  y = fma(y, r, splat(5.0000001201e-1f));
  y = add(fma(y, mul(r, r), r), splat(1.0f));
  Lanes half = nearest_whole(mul(k, splat(0.5f)));
  y = mul(mul(y, power_of_two(half)), power_of_two(sub(k, half)));
  y = above_or(x, kLowestExp, y, zero());
  return above_or(x, kHighestExp, splat(INFINITY), y);
}

static inline float first_lane(Lanes v) {
  alignas(64) float lanes[32];
  store(lanes, v);
  return lanes[0];
}

static inline float exp_one(float x) { return first_lane(exp_flushed(splat(x))); }

struct RowMaximum {
  float value;
  bool nan;  // the row holds a NaN (value is then meaningless)
};

static inline RowMaximum row_maximum(const float* x, int64_t width) {
  Lanes largest = splat(-INFINITY);
  uint32_t nan = 0;
  for (int64_t at = 0; at < width; at += 32) {
    Lanes v = load_chunk(x, at, width);
    nan |= nan_lanes(v);
    largest = larger(v, largest);
  }
  alignas(64) float lanes[32];
  store(lanes, largest);
  float value = lanes[0];
  for (int i = 1; i < 32; ++i) value = lanes[i] > value ? lanes[i] : value;
  return {value, nan != 0};
}

// The first index of the row's largest entry, a NaN counting as the largest
// (torch.argmax's and NumPy's answer); -1 for an empty row.
static inline int64_t row_first_argmax(const float* x, int64_t width) {
  if (width == 0) return -1;
  RowMaximum largest = row_maximum(x, width);
  for (int64_t at = 0; at < width; at += 32) {
    Lanes v = load_chunk(x, at, width);
    uint32_t hits = largest.nan ? nan_lanes(v) : equal_lanes(v, largest.value);
    if (hits != 0) return at + __builtin_ctz(hits);
  }
  return 0;  // unreachable: the largest entry is in the row
}

// y = x - max - ln Σ exp(x - max); a row with a NaN gives NaNs, as PyTorch's does.
static inline void row_log_softmax(const float* x, int64_t width, float* y) {
  RowMaximum largest = row_maximum(x, width);
  if (largest.nan) {
    std::fill(y, y + width, NAN);
    return;
  }
  Lanes shift = splat(largest.value), total = zero();
  for (int64_t at = 0; at < width; at += 32)
    total = add(total, exp_flushed(sub(load_chunk(x, at, width), shift)));
  Lanes log_total = splat(std::log(sum(total)));
  for (int64_t at = 0; at < width; at += 32)
    store_chunk(y, at, width, sub(sub(load_chunk(x, at, width), shift), log_total));
}

static inline void row_probabilities(const float* logprobs, int64_t width, float* y) {
  for (int64_t at = 0; at < width; at += 32)
    store_chunk(y, at, width, exp_flushed(load_chunk(logprobs, at, width)));
}

// -Σ P log P, a NaN product (0 · -inf) left out of the sum.
static inline float row_entropy(const float* probs, const float* logprobs, int64_t width) {
  Lanes total = zero();
  for (int64_t at = 0; at < width; at += 32) {
    // A last chunk's padding: probability 0, log -inf, a NaN product.
    Lanes product = mul(load_chunk(probs, at, width, 0.0f), load_chunk(logprobs, at, width));
    total = add(total, without_nan(product));
  }
  return -sum(total);
}

// exp of the largest entry minus exp of the largest of the others (equal to the first
// when it repeats); NaN for a row with a NaN, 0 for a row of fewer than two.
static inline float row_margin(const float* logprobs, int64_t width) {
  if (width < 2) return 0.0f;
  int64_t first = row_first_argmax(logprobs, width);
  float top = logprobs[first];
  if (top != top) return NAN;
  Lanes rest = splat(-INFINITY);
  for (int64_t at = 0; at < width; at += 32) {
    Lanes v = load_chunk(logprobs, at, width);
    if (first >= at && first < at + 32) {
      alignas(64) float lanes[32];
      store(lanes, v);
      lanes[first - at] = -INFINITY;
      v = load(lanes);
    }
    rest = larger(v, rest);
  }
  alignas(64) float lanes[32];
  store(lanes, rest);
  float second = lanes[0];
  for (int i = 1; i < 32; ++i) second = lanes[i] > second ? lanes[i] : second;
  return exp_one(top) - exp_one(second);
}
