// Included once per instruction set, inside that set's namespace, after its Lanes.
//
// y[r, o] = sum_k x[r, k] * w[o, k] for a few rows r. Each weight row is read from
// memory once for every row of x; element k accumulates into lane k % 32 and the lanes
// are summed by one fixed tree, so an output does not depend on how many rows come with
// it, on which thread computes it, or on the instruction set.

// How far ahead of the block being read the weights are fetched: streams of small
// matrices leave the hardware prefetcher too little time to ramp up. (Each Weight says
// from how many rows it fetches ahead: float32 weights on AVX2 from four, lanes_avx2.h
// says why.)
#ifndef HJ_PREFETCH
#define HJ_PREFETCH 8192
#endif
constexpr int64_t kPrefetchBytes = HJ_PREFETCH;

struct Float32Rows {
  static constexpr int kBlockBytes = 128;  // the bytes of weight one block of 32 reads
  static constexpr int64_t kFetchAheadFrom = kFetchFloat32AheadFrom;  // the set's
  const float* w;
  int64_t k;
  static constexpr bool kInParts = true;  // part tiles below
  Lanes block(int64_t o, int64_t b) const { return load(w + o * k + b * 32); }
  Part part(int64_t o, int64_t b, int q) const { return part_load(part_address(o, b, q)); }
  const float* part_address(int64_t o, int64_t b, int q) const {
    return w + o * k + b * 32 + q * kPartFloats;
  }
  const void* address(int64_t o, int64_t b) const { return w + o * k + b * 32; }
  float finish(int64_t, float total) const { return total; }
};

struct Int8Rows {  // per-output-channel scale, applied to the finished sum
  static constexpr int kBlockBytes = 32;
  static constexpr bool kInParts = false;
  static constexpr int64_t kFetchAheadFrom = 1;
  const int8_t* w;
  const float* scale;
  int64_t k;
  Lanes block(int64_t o, int64_t b) const { return load_int8(w + o * k + b * 32); }
  const void* address(int64_t o, int64_t b) const { return w + o * k + b * 32; }
  float finish(int64_t o, float total) const { return total * scale[o]; }
};

struct Int4Rows {  // a scale and a minimum per group of inputs: w = q * scale + min
  static constexpr int kBlockBytes = 16;
  static constexpr bool kInParts = false;
  static constexpr int64_t kFetchAheadFrom = 1;
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

// A tile of kOutputs consecutive outputs times kRows rows: each block of x is loaded once
// for the tile's outputs, each block of weight once for its rows. (kTileOutputs, from the
// set's Lanes, is as many as its registers hold beside the accumulators.) Every output's
// lanes take the same multiply-adds in the same order whatever the tile.
template <int kOutputs, int kRows, class Weight>
static inline void output_tile(const Weight& weight, int64_t o, const float* x, int64_t x_row,
                               int64_t blocks, float* y, int64_t y_row) {
  Lanes acc[kOutputs][kRows];
  for (int j = 0; j < kOutputs; ++j)
    for (int r = 0; r < kRows; ++r) acc[j][r] = zero();
  for (int64_t b = 0; b < blocks; ++b) {
    Lanes w[kOutputs];
    for (int j = 0; j < kOutputs; ++j) {
      if constexpr (kRows >= Weight::kFetchAheadFrom) {
        const char* ahead = static_cast<const char*>(weight.address(o + j, b)) + kPrefetchBytes;
        for (int line = 0; line < Weight::kBlockBytes; line += 64) __builtin_prefetch(ahead + line);
      }
      w[j] = weight.block(o + j, b);
    }
    for (int r = 0; r < kRows; ++r) {
      Lanes xr = load(x + r * x_row + b * 32);
      // Loaded once for the tile's outputs: left to itself, the compiler folds the load
      // into every output's multiply-add, and a tile of many rows is then bound by its
      // loads (SmolLM2's LM head times 32 rows on AVX-512: 16 ms folded, 12-13 pinned).
      if constexpr (kOutputs > 1) in_registers(xr);
      for (int j = 0; j < kOutputs; ++j) acc[j][r] = fma(xr, w[j], acc[j][r]);
    }
  }
  for (int j = 0; j < kOutputs; ++j)
    for (int r = 0; r < kRows; ++r) y[r * y_row + o + j] = weight.finish(o + j, sum(acc[j][r]));
}

// A tile as output_tile's, one part of the lanes at a time (lanes_avx2.h says why): part q
// of every output's accumulators runs over all the blocks, then the next part. Each lane
// still takes its multiply-adds in block order and the lanes are summed by the same tree,
// so the bits are output_tile's. Only the first part reads the weights from memory; the
// others find the tile's rows of weight (a few KB) in the L1 cache.
template <int kOutputs, int kRows, class Weight>
static inline void part_tile(const Weight& weight, int64_t o, const float* x, int64_t x_row,
                             int64_t blocks, float* y, int64_t y_row) {
  Part done[kOutputs][kRows][kParts];
  for (int q = 0; q < kParts; ++q) {
    Part acc[kOutputs][kRows];
    for (int j = 0; j < kOutputs; ++j)
      for (int r = 0; r < kRows; ++r) acc[j][r] = part_zero();
    for (int64_t b = 0; b < blocks; ++b) {
      Part w[kOutputs];
      for (int j = 0; j < kOutputs; ++j) {
        // The next tile's weights fetched while this one computes, the same part of the
        // same block, so that the fetches spread over the four passes: a part reads 32
        // bytes of every 128, a stride the hardware prefetcher follows too slowly alone
        // (lanes_avx2.h).
        __builtin_prefetch(weight.part_address(o + kOutputs + j, b, q));
        w[j] = weight.part(o + j, b, q);
      }
      for (int r = 0; r < kRows; ++r) {
        Part xr = part_load(x + r * x_row + b * 32 + q * kPartFloats);
        if constexpr (kOutputs > 1) in_registers(xr);  // loaded once for the tile's outputs
        for (int j = 0; j < kOutputs; ++j) acc[j][r] = part_fma(xr, w[j], acc[j][r]);
      }
    }
    for (int j = 0; j < kOutputs; ++j)
      for (int r = 0; r < kRows; ++r) done[j][r][q] = acc[j][r];
  }
  for (int j = 0; j < kOutputs; ++j)
    for (int r = 0; r < kRows; ++r)
      y[r * y_row + o + j] = weight.finish(o + j, sum(from_parts(done[j][r])));
}

// fn.template operator()<n>(r) for the rows r.. r + n of `rows`, in groups of 4 and the rest.
template <class Fn>
static inline void in_row_groups(int64_t rows, const Fn& fn) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) fn.template operator()<4>(r);
  switch (rows - r) {
    case 3: fn.template operator()<3>(r); break;
    case 2: fn.template operator()<2>(r); break;
    case 1: fn.template operator()<1>(r); break;
    default: break;
  }
}

// fn.template operator()<kOutputs, kRows>(o, r) for tiles of kOutputs outputs from o (up
// to `last`; o is left at the first output no tile took) times every row, in groups of up
// to 4 rows.
template <int kOutputs, class Fn>
static inline void output_tiles(int64_t& o, int64_t last, int64_t rows, const Fn& fn) {
  for (; o + kOutputs <= last; o += kOutputs)
    in_row_groups(rows,
                  [&]<int kRows>(int64_t r) { fn.template operator()<kOutputs, kRows>(o, r); });
}

// From this many rows on, a product is bound by the multiply-adds more than by the
// weights' stream, and tiles of kTileOutputs outputs pay (2-core AMD EPYC, SmolLM2's
// layers and LM head in float32, activations kept in registers: 8 to 11 rows 1.1-1.2x
// faster tiled, 4 and 5 rows slower; with the loads folded the tiles paid from 12 rows.
// int8 and int4 weights with float activations, 8 to 11 rows: 1.27-1.34x and 1.13-1.29x).
constexpr int64_t kTiledRows = 8;

// Outputs [first, last) of one stack member, every row of x: tiles of kTileOutputs
// outputs for many rows, then (or else) one output at a time.
template <class Weight>
static void outputs(const Weight& weight, int64_t first, int64_t last, const float* x,
                    int64_t rows, int64_t x_row, int64_t blocks, float* y, int64_t y_row) {
  int64_t o = first;
  if constexpr (Weight::kInParts)
    if (kPartTilesFrom > 0 && rows >= kPartTilesFrom) {
      auto tile = [&]<int kOutputs, int kRows>(int64_t from, int64_t r) {
        part_tile<kOutputs, kRows>(weight, from, x + r * x_row, x_row, blocks, y + r * y_row,
                                   y_row);
      };
      output_tiles<kPartTileOutputs>(o, last, rows, tile);
      output_tiles<1>(o, last, rows, tile);
      return;
    }
  auto tile = [&]<int kOutputs, int kRows>(int64_t from, int64_t r) {
    output_tile<kOutputs, kRows>(weight, from, x + r * x_row, x_row, blocks, y + r * y_row, y_row);
  };
  if (rows >= kTiledRows) output_tiles<kTileOutputs>(o, last, rows, tile);
  output_tiles<1>(o, last, rows, tile);
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

// Quantized activations: int8 and int4 weights times activations quantized to int8 per
// block of 32 inputs (QuantizedRows, kernels.cpp). A chunk of 64 inputs is 16 lanes of 4
// (lanes 0-7 its first block, 8-15 its second; a last block of 32 alone is a chunk whose
// second block is zero); a lane's integer sum is exact, then
//   int8: acc = fma(float(w . q), d, acc),                       y = sum16(acc) * scale[o]
//   int4: acc = fma(float(w . q) * scale_g, d, acc),   then per 16 blocks b..b + 15
//         acc = fma(min_g(b..), block_sum[b..], acc),   y = sum16(acc)
// in chunk order, block_sum being each block's d times the sum of its q (QuantizedRows):
// the minimums' part once a row per output, not in every chunk. So an output is the same
// on every set, thread and batch, as above.

// kOutputs consecutive outputs (rows of w `inputs` apart) times kRows rows, as
// int4_output_rows below: every output takes the same operations whatever the tile.
template <int kOutputs, int kRows>
static inline void int8_output_rows(const int8_t* w, const float* scale, const QuantizedRows& x,
                                    int64_t row, int64_t inputs, float* y, int64_t y_row) {
  Floats16 acc[kOutputs][kRows];
  for (int j = 0; j < kOutputs; ++j)
    for (int r = 0; r < kRows; ++r) acc[j][r] = zero16();
  auto add = [&](int64_t c, const Int8Chunk (&chunk)[kOutputs]) {
    for (int r = 0; r < kRows; ++r) {
      int64_t at = (row + r) * x.padded + c * 64;
      Floats16 steps = load16(x.step + at / 4);
      for (int j = 0; j < kOutputs; ++j) {
        Ints16 dot = dot_int8(chunk[j], x.q + at, x.biased + at);
        acc[j][r] = fma16(to_float16(dot), steps, acc[j][r]);
      }
    }
  };
  Int8Chunk chunk[kOutputs];
  int64_t c = 0;
  for (; c < inputs / 64; ++c) {
    for (int j = 0; j < kOutputs; ++j) {
      __builtin_prefetch(w + j * inputs + c * 64 + kPrefetchBytes);
      chunk[j] = load_int8_chunk(w + j * inputs + c * 64);
    }
    add(c, chunk);
  }
  if (inputs % 64) {
    for (int j = 0; j < kOutputs; ++j) chunk[j] = load_int8_tail(w + j * inputs + c * 64);
    add(c, chunk);
  }
  for (int j = 0; j < kOutputs; ++j)
    for (int r = 0; r < kRows; ++r) y[r * y_row + j] = sum16(acc[j][r]) * scale[j];
}

// Adds the minimums' part of one output for one row to its lanes: min_g(b) times
// block_sum[b] for every block b, block b into lane b % 16 (the row's block sums are zero
// past its blocks).
static inline Floats16 add_int4_minimums(Floats16 acc, const float* minimum, int64_t group_blocks,
                                         const float* block_sum, int64_t blocks) {
  for (int64_t b = 0; b < blocks; b += 16) {
    Floats16 minimums;
    if (group_blocks == 1) {
      minimums = b + 16 <= blocks ? load16(minimum + b) : load16_first(minimum + b, blocks - b);
    } else {  // groups of several blocks: each block's group's minimum
      float spread[16] = {};
      for (int64_t l = 0; l < 16 && b + l < blocks; ++l)
        spread[l] = minimum[(b + l) / group_blocks];
      minimums = load16(spread);
    }
    acc = fma16(minimums, load16(block_sum + b), acc);
  }
  return acc;
}

// kOutputs consecutive outputs (rows of w `groups` groups apart in scale and minimum) times
// kRows rows: each chunk's activations and steps are loaded once for the tile's outputs,
// and the outputs' chains run side by side (lanes_avx2.h says what it gains). Every
// output takes the same operations in the same order whatever the tile.
template <int kOutputs, int kRows>
static inline void int4_output_rows(const uint8_t* w, const float* scale, const float* minimum,
                                    int64_t groups, int64_t group_blocks, const QuantizedRows& x,
                                    int64_t row, int64_t inputs, float* y, int64_t y_row) {
  Floats16 acc[kOutputs][kRows];
  for (int j = 0; j < kOutputs; ++j)
    for (int r = 0; r < kRows; ++r) acc[j][r] = zero16();
  // Groups g0 and g1 of a chunk's two blocks (g1 < 0: a tail, its second block zero).
  auto add = [&](int64_t c, const Int4Chunk (&chunk)[kOutputs], int64_t g0, int64_t g1) {
    Floats16 s[kOutputs];  // each output's scales, for every row
    for (int j = 0; j < kOutputs; ++j) {
      const float* scales = scale + j * groups;
      s[j] = pair16(scales[g0], g1 < 0 ? 0.0f : scales[g1]);
    }
    for (int r = 0; r < kRows; ++r) {
      int64_t at = (row + r) * x.padded + c * 64;
      Floats16 steps = load16(x.step + at / 4);
      for (int j = 0; j < kOutputs; ++j) {
        Floats16 lanes = mul16(to_float16(dot_int4(chunk[j], x.q + at)), s[j]);
        acc[j][r] = fma16(lanes, steps, acc[j][r]);
      }
    }
  };
  // Each block's group by counting, not dividing: two integer divisions a chunk cost
  // more than the chunk's own arithmetic.
  int64_t g = 0, block_in_group = 0;
  auto next_group = [&]() {
    int64_t current = g;
    if (++block_in_group == group_blocks) block_in_group = 0, ++g;
    return current;
  };
  const int64_t row_bytes = inputs / 2;
  Int4Chunk chunk[kOutputs];
  int64_t c = 0;
  for (; c < inputs / 64; ++c) {
    for (int j = 0; j < kOutputs; ++j) {
      __builtin_prefetch(w + j * row_bytes + c * 32 + kPrefetchBytes);
      chunk[j] = unpack_int4_chunk(w + j * row_bytes + c * 32);
    }
    int64_t g0 = next_group(), g1 = next_group();
    add(c, chunk, g0, g1);
  }
  if (inputs % 64) {
    for (int j = 0; j < kOutputs; ++j) chunk[j] = unpack_int4_tail(w + j * row_bytes + c * 32);
    add(c, chunk, next_group(), -1);
  }
  for (int j = 0; j < kOutputs; ++j)
    for (int r = 0; r < kRows; ++r)
      y[r * y_row + j] = sum16(add_int4_minimums(acc[j][r], minimum + j * groups, group_blocks,
                                                 x.block_sum + (row + r) * x.block_row,
                                                 inputs / 32));
}

static void int8_quantized_rows(const Problem& p, const QuantizedRows& x, const int8_t* w,
                                const float* scale) {
  for_each_range(p, [&](int64_t s, int64_t first, int64_t last) {
    const int8_t* member = w + s * p.outputs * p.inputs;
    float* y = p.y + s * p.rows * p.outputs;
    int64_t row = x.member_rows * s;
    auto tile = [&]<int kOutputs, int kRows>(int64_t from, int64_t r) {
      int8_output_rows<kOutputs, kRows>(member + from * p.inputs, scale + s * p.outputs + from, x,
                                        row + r, p.inputs, y + r * p.outputs + from, p.outputs);
    };
    // One output at a time for one row (its weights' stream decides it); for more rows as
    // many as the set's registers hold (kInt8RowsTileOutputs), then the outputs left.
    int64_t o = first;
    if (p.rows > 1) output_tiles<kInt8RowsTileOutputs>(o, last, p.rows, tile);
    output_tiles<1>(o, last, p.rows, tile);
  });
}

static void int4_quantized_rows(const Problem& p, const QuantizedRows& x, const uint8_t* w,
                                const float* scale, const float* minimum, int64_t group) {
  int64_t groups = p.inputs / group;
  for_each_range(p, [&](int64_t s, int64_t first, int64_t last) {
    const uint8_t* member = w + s * p.outputs * (p.inputs / 2);
    float* y = p.y + s * p.rows * p.outputs;
    int64_t row = x.member_rows * s;
    auto tile = [&]<int kOutputs, int kRows>(int64_t from, int64_t r) {
      int64_t g = (s * p.outputs + from) * groups;
      int4_output_rows<kOutputs, kRows>(member + from * (p.inputs / 2), scale + g, minimum + g,
                                        groups, group / 32, x, row + r, p.inputs,
                                        y + r * p.outputs + from, p.outputs);
    };
    // As many outputs a tile as the set's registers hold for one row, or for more
    // (kInt4TileOutputs, kInt4RowsTileOutputs), then the outputs left one at a time.
    int64_t o = first;
    if (p.rows == 1) output_tiles<kInt4TileOutputs>(o, last, p.rows, tile);
    else output_tiles<kInt4RowsTileOutputs>(o, last, p.rows, tile);
    output_tiles<1>(o, last, p.rows, tile);
  });
}
