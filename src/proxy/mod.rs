//! The proxy engine (issue #3): one thread per worker that watches the trigger words GPUs write,
//! advances protocol state machines and writes completion words, without ever calling a blocking
//! CUDA API while a user stream may wait on it. Not built yet: today every operation starts on
//! the calling thread and progresses through `Worker::progress`.
