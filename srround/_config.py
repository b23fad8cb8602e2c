"""Launch tunables in one place. Tests patch them small so that the CUDA simulator covers the
multi-block, grid-stride paths quickly (``monkeypatch.setattr(srround._config, ...)``)."""

# CUDA: threads per block, and the grid size cap (blocks); each thread handles one counter block
# of four elements per grid-stride iteration.
CUDA_THREADS_PER_BLOCK = 256
CUDA_MAX_BLOCKS = 4096

# CUDA: how many tensor-list tables (``unscale_and_check``) keep their device copies.
CUDA_TABLES_KEPT = 8

# CPU: calls on fewer elements than this run their prange loop on the calling thread alone
# (``_cpu.run``): waking the worker threads costs more than the work, and on a busy machine a
# whole scheduler time slice.
CPU_SERIAL_BELOW = 1 << 16
