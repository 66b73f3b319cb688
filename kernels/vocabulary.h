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
// Cephes Math Library), times 2^k rounded once.
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
  y = times_power_of_two(y, k);
  y = above_or(x, kLowestExp, y, zero());
  return above_or(x, kHighestExp, splat(INFINITY), y);
}

static inline float first_lane(Lanes v) {
  alignas(64) float lanes[32];
  store(lanes, v);
  return lanes[0];
}

static inline float exp_one(float x) { return first_lane(exp_flushed(splat(x))); }

// The largest of the lanes (exact, so in any order); NaN lanes are the caller's to rule out.
static inline float largest_lane(Lanes v) {
  alignas(64) float lanes[32];
  store(lanes, v);
  float value = lanes[0];
  for (int i = 1; i < 32; ++i) value = lanes[i] > value ? lanes[i] : value;
  return value;
}

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
  return {largest_lane(largest), nan != 0};
}

// The first index of `largest` in the row (of a NaN, if it holds one).
static inline int64_t row_first_of(const float* x, int64_t width, RowMaximum largest) {
  for (int64_t at = 0; at < width; at += 32) {
    Lanes v = load_chunk(x, at, width);
    uint32_t hits = largest.nan ? nan_lanes(v) : equal_lanes(v, largest.value);
    if (hits != 0) return at + __builtin_ctz(hits);
  }
  return 0;  // unreachable: the largest entry is in the row
}

// The first index of the row's largest entry, a NaN counting as the largest
// (torch.argmax's and NumPy's answer); -1 for an empty row.
static inline int64_t row_first_argmax(const float* x, int64_t width) {
  return width == 0 ? -1 : row_first_of(x, width, row_maximum(x, width));
}

// A chunk of x divided by `scale` (a temperature; 1: x as it is), as PyTorch's x / scale
// rounds it.
static inline Lanes load_scaled(const float* x, int64_t at, int64_t width, float scale) {
  Lanes v = load_chunk(x, at, width);
  return scale == 1.0f ? v : div(v, splat(scale));
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

// P log P of a chunk, a NaN product (0 · -inf, and a last chunk's padding: probability 0,
// log -inf) as 0.
static inline Lanes entropy_terms(Lanes probs, Lanes logprobs) {
  return without_nan(mul(probs, logprobs));
}

// -Σ P log P.
static inline float row_entropy(const float* probs, const float* logprobs, int64_t width) {
  Lanes total = zero();
  for (int64_t at = 0; at < width; at += 32)
    total = add(total, entropy_terms(load_chunk(probs, at, width, 0.0f),
                                     load_chunk(logprobs, at, width)));
  return -sum(total);
}

// Each lane's largest value and the largest of the rest of that lane (equal to it when it
// repeats), over the chunks seen; then the row's two largest the same way. Every step is
// a max or a min, exact, so any order of the lanes gives the same two values.
struct TopTwo {
  Lanes first = splat(-INFINITY), second = splat(-INFINITY);

  void see(Lanes v) {
    second = larger(second, smaller(first, v));
    first = larger(first, v);
  }

  // exp of the row's largest value minus exp of the largest of the others.
  float margin() const {
    alignas(64) float tops[32], seconds[32];
    store(tops, first);
    store(seconds, second);
    int winner = 0;
    for (int i = 1; i < 32; ++i) winner = tops[i] > tops[winner] ? i : winner;
    float rest = seconds[winner];
    for (int i = 0; i < 32; ++i) rest = i != winner && tops[i] > rest ? tops[i] : rest;
    return exp_one(tops[winner]) - exp_one(rest);
  }
};

// exp of the largest entry minus exp of the largest of the others (equal to the first
// when it repeats); NaN for a row with a NaN, 0 for a row of fewer than two.
static inline float row_margin(const float* logprobs, int64_t width) {
  if (width < 2) return 0.0f;
  TopTwo top;
  uint32_t nan = 0;
  for (int64_t at = 0; at < width; at += 32) {
    Lanes v = load_chunk(logprobs, at, width);
    nan |= nan_lanes(v);
    top.see(v);
  }
  return nan != 0 ? NAN : top.margin();
}

// What a round reads of one target row (kernels.cpp's target_rows): its passes one after
// the other, in one call. (One pass for all of them after the sum was slower: with an exp
// and four accumulators of 32 lanes live, AVX2's sixteen registers spill. Two, the margin
// kept while writing log P and the entropy and P's largest while writing P, 2026-11-29:
// AVX-512 5-14% faster, AVX2 20-33% slower, a row after streaming 64 MiB and warm.)
static inline TargetRow target_row(const float* x, int64_t width, float* logprobs, float* probs) {
  row_log_softmax(x, width, logprobs);
  row_probabilities(logprobs, width, probs);
  return {row_entropy(probs, logprobs, width), row_margin(logprobs, width),
          row_first_argmax(probs, width)};
}

// One position of a jury (kernels.cpp's jury_rows): `jurors` rows of `width` logits,
// `stride` apart. Into `total`, the sum in juror order of each row divided by `scale` (a
// temperature) less its maximum, so that each term's largest entry is 0; into
// votes[j * vote_stride], each row's first argmax (a juror's vote). No exp: a juror's
// normaliser is a constant of the row, which the target's normalisation removes
// (poe/target.py). A division rounded to nearest never puts a larger value below a
// smaller one, so the quotient's maximum is the maximum's quotient. A row with a NaN
// makes its term NaN (its shift is NaN); no jurors make a total of 0.
static inline void jury_row(const float* x, int64_t jurors, int64_t stride, int64_t width,
                            float scale, float* total, int64_t* votes, int64_t vote_stride) {
  std::vector<float> shifts(jurors);
  for (int64_t j = 0; j < jurors; ++j) {
    const float* row = x + j * stride;
    RowMaximum largest = row_maximum(row, width);
    shifts[j] = largest.nan ? NAN : largest.value / scale;  // (exact for a scale of 1)
    votes[j * vote_stride] = width == 0 ? -1 : row_first_of(row, width, largest);
  }
  for (int64_t at = 0; at < width; at += 32) {
    Lanes sum = zero();
    for (int64_t j = 0; j < jurors; ++j) {
      Lanes term = sub(load_scaled(x + j * stride, at, width, scale), splat(shifts[j]));
      sum = j == 0 ? term : add(sum, term);
    }
    store_chunk(total, at, width, sum);
  }
}
