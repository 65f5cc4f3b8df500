"""mxlib: microscaling (OCP MX, NVFP4) quantization emulation for Mixture-of-Experts models.

``mxlib.formats``    the format table; ``mxlib.reference`` the pure-PyTorch oracle;
``mxlib.kernels``    Triton twins (import after setting ``TRITON_INTERPRET=1`` to run on the CPU);
``mxlib.moe``        routing, the fused-MoE experts and their emulation subclasses;
``mxlib.models``     the Qwen3-30B-A3B preset, dummy checkpoints, ModelOpt and Quark loaders;
``mxlib.analysis``   error metrics; ``mxlib.plots`` plotly figures.
"""

__version__ = "0.1.0"
