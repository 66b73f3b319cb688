"""What every hydra-jury server shares: the aio server with health, reflection and
graceful shutdown (`server`), the one exception ⇄ status-code map (`errors`), the model
thread (`model_thread`), the worker servicer base (`servicer`), calls and results ⇄
internal messages (`internal_wire`), the command-line flags every server takes
(`flags`), and the start-up and command line of a worker service (`worker_service`)."""
