"""The coefficients of the CPU backend's float32 erf, shared by the numpy paths and the numba
loops (a module of its own: :mod:`polyhal_cpu.native_loops` imports numba, which
:mod:`polyhal_cpu.native` defers)."""

#: erf(z) ~= z * P(z^2) / Q(z^2) on [-4, 4], the rational approximation XLA and Eigen use for
#: single precision (coefficients highest power first; see polyhal_cpu.kernels' erf).
ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
         -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
         -1.42647390514189e-02)
