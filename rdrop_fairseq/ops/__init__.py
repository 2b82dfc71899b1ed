"""R-Drop's row-pair computation, the heart of its fused loss, as Liger-Kernel lays out its
ops: the contract (:mod:`.rows`), one implementation per file (:mod:`.rows_torch`, the torch
reference; :mod:`.rows_triton`, the CUDA kernel), and the one door to them (:mod:`.impl`:
which implementation can run, :func:`.impl.run_rows` the call of either, and the
fall-back). Nothing here imports fairseq or transformers; the kernel's module imports
triton only when it is itself imported (lazily, by :mod:`.impl`)."""
