// Included once per instruction set, inside that set's namespace, after its Lanes.
//
// y[r, o] = sum_k x[r, k] * w[o, k] for a few rows r. Each weight row is read from
// memory once for every row of x; element k accumulates into lane k % 32 and the lanes
// are summed by one fixed tree, so an output does not depend on how many rows come with
// it, on which thread computes it, or on the instruction set.

struct Float32Rows {
  static constexpr int kBlockBytes = 128;  // the bytes of weight one block of 32 reads
  const float* w;
  int64_t k;
  Lanes block(int64_t o, int64_t b) const { return load(w + o * k + b * 32); }
  const void* address(int64_t o, int64_t b) const { return w + o * k + b * 32; }
  float finish(int64_t, float total) const { return total; }
};

struct Int8Rows {  // per-output-channel scale, applied to the finished sum
  static constexpr int kBlockBytes = 32;
  const int8_t* w;
  const float* scale;
  int64_t k;
  Lanes block(int64_t o, int64_t b) const { return load_int8(w + o * k + b * 32); }
  const void* address(int64_t o, int64_t b) const { return w + o * k + b * 32; }
  float finish(int64_t o, float total) const { return total * scale[o]; }
};

struct Int4Rows {  // a scale and a minimum per group of inputs: w = q * scale + min
  static constexpr int kBlockBytes = 16;
  const uint8_t* w;
  const float* scale;
  const float* minimum;
  int64_t k, groups, group_blocks;  // groups per row, blocks of 32 per group
  Lanes block(int64_t o, int64_t b) const {
    // No division for the default group of 32 (one block per group).
    int64_t g = o * groups + (group_blocks == 1 ? b : b / group_blocks);
    return scale_shift(load_int4(w + o * (k / 2) + b * 16), scale[g], minimum[g]);
  }
  const void* address(int64_t o, int64_t b) const { return w + o * (k / 2) + b * 16; }
  float finish(int64_t, float total) const { return total; }
};

// How far ahead of the block being read the weights are fetched: streams of small
// matrices leave the hardware prefetcher too little time to ramp up.
#ifndef HJ_PREFETCH
#define HJ_PREFETCH 8192
#endif
constexpr int64_t kPrefetchBytes = HJ_PREFETCH;

template <int kRows, class Weight>
static inline void output_rows(const Weight& weight, int64_t o, const float* x, int64_t x_row,
                               int64_t blocks, float* y, int64_t y_row) {
  Lanes acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const char* ahead = static_cast<const char*>(weight.address(o, b)) + kPrefetchBytes;
    for (int line = 0; line < Weight::kBlockBytes; line += 64) __builtin_prefetch(ahead + line);
    Lanes w = weight.block(o, b);
    for (int r = 0; r < kRows; ++r) acc[r] = fma(load(x + r * x_row + b * 32), w, acc[r]);
  }
  for (int r = 0; r < kRows; ++r) y[r * y_row + o] = weight.finish(o, sum(acc[r]));
}

// Outputs [first, last) of one stack member, every row of x.
template <class Weight>
static void outputs(const Weight& weight, int64_t first, int64_t last, const float* x,
                    int64_t rows, int64_t x_row, int64_t blocks, float* y, int64_t y_row) {
  for (int64_t o = first; o < last; ++o) {
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      output_rows<4>(weight, o, x + r * x_row, x_row, blocks, y + r * y_row, y_row);
    switch (rows - r) {
      case 3: output_rows<3>(weight, o, x + r * x_row, x_row, blocks, y + r * y_row, y_row); break;
      case 2: output_rows<2>(weight, o, x + r * x_row, x_row, blocks, y + r * y_row, y_row); break;
      case 1: output_rows<1>(weight, o, x + r * x_row, x_row, blocks, y + r * y_row, y_row); break;
      default: break;
    }
  }
}

static void float32(const Problem& p, const float* w) {
  for_each_range(p, [&](int64_t s, int64_t first, int64_t last) {
    Float32Rows weight{w + s * p.outputs * p.inputs, p.inputs};
    outputs(weight, first, last, p.x + s * p.x_member, p.rows, p.x_row, p.inputs / 32,
            p.y + s * p.rows * p.outputs, p.outputs);
  });
}

static void int8(const Problem& p, const int8_t* w, const float* scale) {
  for_each_range(p, [&](int64_t s, int64_t first, int64_t last) {
    Int8Rows weight{w + s * p.outputs * p.inputs, scale + s * p.outputs, p.inputs};
    outputs(weight, first, last, p.x + s * p.x_member, p.rows, p.x_row, p.inputs / 32,
            p.y + s * p.rows * p.outputs, p.outputs);
  });
}

static void int4(const Problem& p, const uint8_t* w, const float* scale, const float* minimum,
                 int64_t group) {
  int64_t groups = p.outputs * (p.inputs / group);
  for_each_range(p, [&](int64_t s, int64_t first, int64_t last) {
    Int4Rows weight{w + s * p.outputs * (p.inputs / 2), scale + s * groups,
                    minimum + s * groups, p.inputs, p.inputs / group, group / 32};
    outputs(weight, first, last, p.x + s * p.x_member, p.rows, p.x_row, p.inputs / 32,
            p.y + s * p.rows * p.outputs, p.outputs);
  });
}
