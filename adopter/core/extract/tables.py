"""Static tables for :mod:`adopter.core.extract` (no torch import at scan time).

``TENSOR_METHODS`` was generated from ``dir(torch.Tensor)`` (torch 2.13), minus names
that collide with common Python container methods (``index``, ``values``) and hooks.
"""

from __future__ import annotations

TENSOR_METHODS = frozenset(
    """
abs abs_ absolute absolute_ acos acos_ acosh acosh_ add add_ addbmm addbmm_ addcdiv addcdiv_ addcmul
addcmul_ addmm addmm_ addmv addmv_ addr addr_ adjoint all allclose amax amin aminmax angle any
arccos arccos_ arccosh arccosh_ arcsin arcsin_ arcsinh arcsinh_ arctan arctan2 arctan2_ arctan_
arctanh arctanh_ argmax argmin argsort argwhere as_strided as_strided_ as_strided_scatter asin asin_
asinh asinh_ atan atan2 atan2_ atan_ atanh atanh_ baddbmm baddbmm_ bernoulli bernoulli_ bfloat16
bincount bitwise_and bitwise_and_ bitwise_left_shift bitwise_left_shift_ bitwise_not bitwise_not_
bitwise_or bitwise_or_ bitwise_right_shift bitwise_right_shift_ bitwise_xor bitwise_xor_ bmm bool
broadcast_to byte cauchy_ ccol_indices cdouble ceil ceil_ cfloat chalf char cholesky
cholesky_inverse cholesky_solve chunk clamp clamp_ clamp_max clamp_max_ clamp_min clamp_min_ clip
clip_ clone coalesce col_indices conj conj_physical conj_physical_ contiguous copy_ copysign
copysign_ corrcoef cos cos_ cosh cosh_ count_nonzero cov cpu cross crow_indices cuda cummax cummin
cumprod cumprod_ cumsum cumsum_ deg2rad deg2rad_ dense_dim dequantize det detach detach_ diag
diag_embed diagflat diagonal diagonal_scatter diff digamma digamma_ dim dim_order dist div div_
divide divide_ dot double dsplit eig element_size eq eq_ equal erf erf_ erfc erfc_ erfinv erfinv_
exp exp2 exp2_ exp_ expand expand_as expm1 expm1_ exponential_ fill_ fill_diagonal_ fix fix_ flatten
flip fliplr flipud float float_power float_power_ floor floor_ floor_divide floor_divide_ fmax fmin
fmod fmod_ frac frac_ frexp gather gcd gcd_ ge ge_ geometric_ geqrf ger get_device greater greater_
greater_equal greater_equal_ gt gt_ half hardshrink hash_tensor heaviside heaviside_ histc histogram
hsplit hypot hypot_ i0 i0_ igamma igamma_ igammac igammac_ index_add index_add_ index_copy
index_copy_ index_fill index_fill_ index_put index_put_ index_reduce index_reduce_ index_select
indices inner int int_repr inverse ipu is_coalesced is_complex is_conj is_contiguous is_distributed
is_floating_point is_inference is_neg is_nonzero is_pinned is_same_size is_set_to is_shared
is_signed isclose isfinite isinf isnan isneginf isposinf isreal istft item kron kthvalue lcm lcm_
ldexp ldexp_ le le_ lerp lerp_ less less_ less_equal less_equal_ lgamma lgamma_ log log10 log10_
log1p log1p_ log2 log2_ log_ log_normal_ log_softmax logaddexp logaddexp2 logcumsumexp logdet
logical_and logical_and_ logical_not logical_not_ logical_or logical_or_ logical_xor logical_xor_
logit logit_ logsumexp long lstsq lt lt_ lu lu_solve masked_fill masked_fill_ masked_scatter
masked_scatter_ masked_select matmul matrix_exp matrix_power max maximum mean median min minimum mm
mode moveaxis movedim msort mtia mul mul_ multinomial multiply multiply_ mv mvlgamma mvlgamma_
nan_to_num nan_to_num_ nanmean nanmedian nanquantile nansum narrow narrow_copy ndimension ne ne_ neg
neg_ negative negative_ nelement new new_empty new_empty_strided new_full new_ones new_tensor
new_zeros nextafter nextafter_ nonzero nonzero_static norm normal_ not_equal not_equal_ numel numpy
orgqr ormqr outer permute pinverse polygamma polygamma_ positive pow pow_ prelu prod put put_
q_per_channel_axis q_per_channel_scales q_per_channel_zero_points q_scale q_zero_point qr qscheme
quantile rad2deg rad2deg_ random_ ravel reciprocal reciprocal_ relu relu_ remainder remainder_
renorm renorm_ repeat repeat_interleave requires_grad_ reshape reshape_as resize resize_ resize_as
resize_as_ resize_as_sparse_ resolve_conj resolve_neg roll rot90 round round_ row_indices rsqrt
rsqrt_ scatter scatter_ scatter_add scatter_add_ scatter_reduce scatter_reduce_ select
select_scatter set_ sgn sgn_ short sigmoid sigmoid_ sign sign_ signbit sin sin_ sinc sinc_ sinh
sinh_ size slice_inverse slice_scatter slogdet smm softmax solve sort sparse_dim sparse_mask
sparse_resize_ sparse_resize_and_clear_ split split_with_sizes sqrt sqrt_ square square_ squeeze
squeeze_ sspaddmm std stft storage_offset stride sub sub_ subtract subtract_ sum sum_to_size svd
swapaxes swapaxes_ swapdims swapdims_ symeig t t_ take take_along_dim tan tan_ tanh tanh_
tensor_split tile to to_dense to_mkldnn to_padded_tensor to_sparse to_sparse_bsc to_sparse_bsr
to_sparse_coo to_sparse_csc to_sparse_csr tolist topk trace transpose transpose_ triangular_solve
tril tril_ triu triu_ true_divide true_divide_ trunc trunc_ type type_as unbind unflatten unfold
uniform_ unique unique_consecutive unsafe_chunk unsafe_split unsafe_split_with_sizes unsqueeze
unsqueeze_ var vdot view view_as vsplit where xlogy xlogy_ xpu zero_
    """.split()
)

# Tensor methods / attributes that query metadata: no DL node, and the result is not a tensor.
SHAPE_METHODS = frozenset(
    "size dim ndimension numel nelement stride element_size get_device is_contiguous is_floating_point "
    "is_complex item tolist numpy data_ptr storage_offset is_nonzero is_same_size is_signed dim_order "
    "equal allclose".split()
)
META_ATTRS = frozenset("shape dtype device ndim is_cuda requires_grad is_leaf layout is_meta is_sparse".split())
TENSOR_ATTRS = frozenset("T mT H mH data grad real imag".split())

# torch.* callables that are not DL computation (guards, dtype info, tensor factories, context managers).
NON_DL_TORCH_PREFIXES = (
    "torch.jit.", "torch.compiler.", "torch._dynamo.", "torch.fx.", "torch.cuda.", "torch.backends.",
    "torch.distributed.", "torch.utils.", "torch.autograd.graph.", "torch.testing.", "torch.onnx.",
    "torch._C.", "torch.library.", "torch.mps.", "torch.xpu.", "torch.npu.", "torch.amp.", "torch.overrides.",
)
NON_DL_TORCH = frozenset(
    """
    torch.is_tensor torch.is_floating_point torch.is_complex torch.finfo torch.iinfo torch.get_default_dtype
    torch.set_default_dtype torch.is_grad_enabled torch.no_grad torch.enable_grad torch.set_grad_enabled
    torch.inference_mode torch.autocast torch.is_autocast_enabled torch.get_autocast_gpu_dtype
    torch.get_autocast_dtype torch.device torch.dtype torch.Size torch.manual_seed torch.Generator
    torch.arange torch.zeros torch.ones torch.full torch.empty torch.tensor torch.as_tensor torch.eye
    torch.linspace torch.logspace torch.rand torch.randn torch.randint torch.randperm torch.empty_like
    torch.zeros_like torch.ones_like torch.full_like torch.rand_like torch.randn_like torch.from_numpy
    torch.LongTensor torch.FloatTensor torch.BoolTensor torch.Tensor torch.is_inference_mode_enabled
    torch.nn.Parameter torch.nn.Buffer torch.nn.init torch.nn.utils.parametrize
    torch.broadcast_shapes torch.get_device torch.numel torch.typename torch.sym_int torch.sym_float
    torch._assert torch.cond torch.compile
    """.split()
)

# Builtins whose calls never hold a DL node; results are plain Python values.
PY_BUILTINS = frozenset(
    """
    len isinstance issubclass int float bool str tuple list dict set frozenset range enumerate zip
    getattr hasattr setattr min max sum abs round any all sorted reversed map filter type id iter next
    repr format divmod pow hash callable vars super object slice print NotImplementedError ValueError
    """.split()
)
EXTRANEOUS_CALLS = frozenset("print warnings.warn warnings.simplefilter logging.info logging.debug".split())
LOGGER_NAMES = frozenset("logger logging log _logger LOGGER".split())

# ACT2FN / get_activation keys (transformers.activations.ACT2CLS) -> concrete module class.
# The tanh approximations keep distinct type names so a rule can tell them from exact erf GELU.
_TA = "transformers.activations."
ACTIVATIONS = {
    "gelu": "torch.nn.GELU",
    "gelu_10": _TA + "ClippedGELUActivation",
    "gelu_fast": _TA + "FastGELUActivation",
    "gelu_new": _TA + "NewGELUActivation",
    "gelu_python": _TA + "GELUActivation",
    "gelu_pytorch_tanh": _TA + "GELUTanh",
    "gelu_python_tanh": _TA + "GELUTanh",
    "gelu_accurate": _TA + "AccurateGELUActivation",
    "hardswish": "torch.nn.Hardswish",
    "laplace": _TA + "LaplaceActivation",
    "leaky_relu": "torch.nn.LeakyReLU",
    "linear": _TA + "LinearActivation",
    "mish": _TA + "MishActivation",
    "quick_gelu": _TA + "QuickGELUActivation",
    "relu": "torch.nn.ReLU",
    "relu2": _TA + "ReLUSquaredActivation",
    "relu6": "torch.nn.ReLU6",
    "sigmoid": "torch.nn.Sigmoid",
    "silu": "torch.nn.SiLU",
    "sqrtsoftplus": _TA + "SqrtSoftplusActivation",
    "swish": "torch.nn.SiLU",
    "tanh": "torch.nn.Tanh",
    "prelu": "torch.nn.PReLU",
    "xielu": _TA + "XIELUActivation",
}
ACT2FN_TYPE = _TA + "ACT2FN"
