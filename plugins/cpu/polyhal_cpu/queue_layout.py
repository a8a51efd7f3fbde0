"""The layout of the CPU pool's compiled GEMM queue (:func:`polyhal_cpu.parallel.run_gemms`,
:func:`polyhal_cpu.native_loops.serve_gemms`), shared by the compiled loops and the Python that
fills the queue and its tables; it imports nothing.
"""

#: The compiled GEMM queue (:func:`polyhal_cpu.native_loops.serve_gemms`): fields of the queue
#: vector (counters each on a cache line of its own) and of a piece's descriptor (int64; floats
#: as their bits), and the shift of a run's number in the tagged counters.
Q_TAKEN, Q_FINISHED, Q_RUN, Q_COUNT, Q_DESC, Q_STEPS, Q_SIZE = 0, 8, 16, 17, 18, 19, 24
(G_FN, G_WIDE, G_GEMV, G_TA, G_TB, G_M, G_N, G_K, G_ALPHA, G_A, G_LDA, G_B, G_LDB, G_BETA, G_C, G_LDC, G_BIAS,
 G_BIAS_ROW, G_BIAS_COL, G_RES, G_LDR, G_ACT, G_ACT_ALPHA, G_ACT_BETA, G_KIND, G_FIELDS) = range(26)
#: G_KIND of a piece: a GEMM (the fields above), or a layer norm of G_M contiguous rows of G_N
#: at G_A into G_C, scale at G_B, bias at G_BIAS, epsilon (bits) in G_ALPHA.
KIND_GEMM, KIND_LAYER_NORM = 0, 1
RUN_SHIFT = 16
#: The GEMM queue's epilogue code (G_ACT) for a softmax of each row of scores in base-2 units.
SOFTMAX2 = 64
