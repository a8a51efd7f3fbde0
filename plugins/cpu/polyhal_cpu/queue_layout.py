"""The layout of the CPU pool's compiled GEMM queue (:func:`polyhal_cpu.parallel.run_gemms`,
:func:`polyhal_cpu.native_loops.serve_gemms`), shared by the compiled loops and the Python that
fills the queue and its tables; it imports nothing.
"""

#: The compiled GEMM queue (:func:`polyhal_cpu.native_loops.serve_gemms`): fields of the queue
#: vector (counters each on a cache line of its own) and of a piece's descriptor (int64; floats
#: as their bits), and the shift of a run's number in the tagged counters.
Q_TAKEN, Q_FINISHED, Q_RUN, Q_COUNT, Q_DESC, Q_STEPS, Q_SIZE = 0, 8, 16, 17, 18, 19, 24
(G_FN, G_WIDE, G_GEMV, G_TA, G_TB, G_M, G_N, G_K, G_ALPHA, G_A, G_LDA, G_B, G_LDB, G_BETA, G_C, G_LDC, G_BIAS,
 G_BIAS_ROW, G_BIAS_COL, G_RES, G_LDR, G_ACT, G_ACT_ALPHA, G_ACT_BETA, G_KIND) = range(25)
G_FIELDS = 40
#: G_KIND of a piece: a GEMM (the fields above), or a layer norm of G_M contiguous rows of G_N
#: at G_A into G_C, scale at G_B, bias at G_BIAS, epsilon (bits) in G_ALPHA; or a piece of a
#: channels-last convolution (the V_ fields below, :func:`polyhal_cpu.native_loops.conv_piece`).
KIND_GEMM, KIND_LAYER_NORM = 0, 1
#: Convolutions' kinds: a 1x1 conv's block of pixels (``gemm_channels_last``), a depthwise
#: conv's block of output rows (``depthwise_channels_last``, or ``depthwise_flat_rows`` with
#: its taps and bias tiled along a row), a first conv's images/rows (``conv_image_channels_last``).
KIND_POINTWISE, KIND_DEPTHWISE, KIND_DEPTHWISE_FLAT, KIND_IMAGE_CONV = 2, 3, 4, 5
#: An NCHW convolution's block of output-channel panels of one image (``gemm_tiles``): V_X
#: B's source read flat (V_N0 floats), V_W its panels of the packed weights (V_OH panels of
#: V_C = K rows), V_OUT and V_RES its output rows (V_M rows of V_N positions), V_BIAS its
#: bias, V_A its packed panel of B and V_B its tiles (scratch), V_ROWS B's row offsets, V_N1
#: the packed panel's row offsets, V_H the columns, V_WIDTH the plane's width, V_OW the
#: output's, V_BLOCK the columns per block.
KIND_TILES = 6
#: A stride-1 NCHW convolution's block of B's columns (V_H of them from the V_KW-th of padded
#: row V_Y0: output rows times the padded width) and of output channels (V_M rows of panels at
#: V_W), by ``gemm_tiles`` as for KIND_TILES, the output and residual at V_OUT, V_RES from the
#: block's first channel and row (V_N the output's row stride). Its B is its own slab of the
#: zero-padded image, filled first from the image (C, H, W) at V_X: V_KH channels of V_Y1 padded
#: rows from padded row V_Y0, V_WIDTH wide, V_DW floats apart, at V_DH (scratch: V_N0 floats,
#: zeros past the rows); V_SH, V_SW the image's height and width, V_PLANE the floats between its
#: channels, V_PH, V_PW its top and left pads. Where V_SCALE is not 0 the fill applies a
#: prologue as it copies: x * scale[c] + shift[c] (V_SCALE, V_SHIFT: V_KH floats each), then
#: activation V_PRE_ACT (V_PRE_ALPHA, V_PRE_BETA as bits); the padding stays 0. (A 1x1 conv's
#: piece (one tap: V_C = V_KH) is a block of V_H of the image's (C, V_PLANE positions) columns
#: from V_X, filled and computed V_BLOCK columns at a time: its slab C x V_BLOCK, V_DW apart.)
KIND_TILES_SLAB = 7
#: A 2-D max or average pool's block of V_N (image, channel) planes (``pool2d``): V_X, V_OUT
#: its planes, (V_H, V_WIDTH) and (V_OH, V_OW) their sizes, the window's V_KH .. V_DW, V_ACT 1
#: for a max pool, V_A the average's divisors' reciprocals (V_M floats), V_B its scratch
#: (``pool2d_work`` floats), V_ROWS its kernel columns' table (``column_table``).
KIND_POOL = 9
#: A scale_shift's block of (image, channel) rows (:func:`polyhal_cpu.native_loops.scale_shift_piece`):
#: G_M rows of G_N elements at G_A into G_C, the G_K channels' scales at G_B and shifts at
#: G_BIAS, the block's first row's channel in G_LDA, the activation in G_ACT (G_ACT_ALPHA,
#: G_ACT_BETA as bits).
KIND_SCALE_SHIFT = 8
#: A 1x1 convolution's block of B's columns (positions) or of output channels with its input's
#: prologue (a ``scale_shift_conv`` on the pointwise path, conv_kernels._pointwise_prologue):
#: first the G_K channels of G_N columns of the input x (channel 0's first at P_X, P_LDX floats
#: between channels) as act(x * scale[c] + shift[c]) (scales at P_SCALE, shifts at P_SHIFT, the
#: activation P_ACT with P_ALPHA, P_BETA as bits) into B at G_B (the piece's own scratch, G_K
#: rows of G_N: G_LDB = G_N), then the KIND_GEMM piece its G_ fields describe (C = W B + bias,
#: then residual and activation).
KIND_PROLOGUE_GEMM = 10
P_X, P_LDX, P_SCALE, P_SHIFT, P_ACT, P_ALPHA, P_BETA = range(G_KIND + 1, G_KIND + 8)
assert P_BETA < G_FIELDS
#: A convolution piece's fields (G_KIND stays at its index): the operands' addresses (V_X the
#: input, V_W the weights, V_RES 0 where there is none; V_A, V_B a kind's other arrays: scratch
#: or tap offsets; V_ROWS a 1x1 conv's weights' row offsets), the input's shape (N, H, W, C;
#: (pixels, C) for a 1x1 conv), the output's
#: (OH, OW, M), the weights' (KH, KW), strides, pads, dilations, activation (floats as bits),
#: a 1x1 conv's pixel block, and a first conv's images N0 .. N1 and output rows Y0 .. Y1.
(V_X, V_W, V_BIAS, V_RES, V_OUT, V_N, V_H, V_WIDTH, V_C, V_OH, V_OW, V_M, V_KH, V_KW, V_SH, V_SW, V_PH, V_PW, V_DH,
 V_DW, V_ACT, V_ALPHA, V_BETA, V_A) = range(24)
V_B, V_BLOCK, V_N0, V_N1, V_Y0, V_Y1, V_ROWS = range(G_KIND + 1, G_KIND + 8)
#: A slab piece's own fields past those (see KIND_TILES_SLAB): the slab kind takes all 32 above
#: (G_KIND's 24 included), hence descriptors of 40 fields (these 32 .. 37; 38 and 39 free).
V_PLANE, V_SCALE, V_SHIFT, V_PRE_ACT, V_PRE_ALPHA, V_PRE_BETA = range(V_ROWS + 1, V_ROWS + 7)
assert V_PRE_BETA < G_FIELDS
RUN_SHIFT = 16
#: The GEMM queue's epilogue code (G_ACT) for a softmax of each row of scores in base-2 units.
SOFTMAX2 = 64
