"""Model work without transport: the calls and results the decoding loop exchanges with
the model (`calls`), the errors a worker raises (`errors`), per-session caches and the
position rule (`sessions`), and the trunk and jury workers (`trunk`, `jury`). The trunk
and jury services wrap the workers in gRPC; the in-process backend calls them directly.
"""
