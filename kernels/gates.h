// Included once per instruction set, inside that set's namespace, after vocabulary.h (whose
// exp it uses).
//
// A gated MLP's input, silu(gate) * up = gate / (1 + e^-gate) * up, over a row of `width`
// inputs, 32 at a time. The exp is vocabulary.h's, so each set gives the scalar
// reference's bits. Its flushing changes nothing here: an e^-gate below float's smallest
// normal adds nothing to 1, and one above its largest is +inf as the C library's is.
static void silu_times(const float* gate, const float* up, int64_t width, float* out) {
  for (int64_t at = 0; at < width; at += 32) {
    Lanes g = load_chunk(gate, at, width, 0.0f);
    Lanes e = exp_flushed(sub(zero(), g));
    store_chunk(out, at, width, mul(div(g, add(splat(1.0f), e)), load_chunk(up, at, width, 0.0f)));
  }
}
