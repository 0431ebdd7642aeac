//! tpu-dynamo-cache: the shape-keyed executable cache (in memory now, on disk in a later issue).
