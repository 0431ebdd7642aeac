//! tpu-dynamo-runtime: a safe API over any PJRT plugin (load, client, buffers, compile, execute).
