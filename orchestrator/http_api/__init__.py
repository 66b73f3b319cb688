"""The OpenAI-compatible HTTP API of the Generation servers (`--http-listen`), beside the
gRPC API and translated to it: every request becomes `hydrajury.v1.GenerateRequest`s that
run through `GenerationServicer.generate`, the one path of the gRPC API's generations
(the same options, checks, limits, sessions, API keys and metrics), in the same process
and event loop.

- `requests`: the OpenAI request bodies, what is taken, refused or translated, and the
  `hydra` extension (PoE options, sessions);
- `choices`: the request's `n` generations, each on a session, run at once;
- `responses`: OpenAI's response and chunk objects from the outputs;
- `errors`: errors as OpenAI's JSON, with the HTTP status of each gRPC status code;
- `app`: the Starlette application (routes, API keys, body limit, streaming, client
  disconnects).

docs/http-api.md describes the API for its users.
"""
