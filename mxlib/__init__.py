"""mxlib: microscaling (OCP MX, NVFP4) quantization emulation for Mixture-of-Experts models.

``mxlib.formats``    the format table; ``mxlib.reference`` the pure-PyTorch oracle;
``mxlib.kernels``    Triton twins (Triton's interpreter on machines without CUDA);
``mxlib.moe``        schemes, routing, the fused-MoE experts, their emulation subclasses and their factory;
``mxlib.models``     the Qwen3-30B-A3B preset, calibration, checkpoint layouts (ModelOpt, Quark);
``mxlib.analysis``   error metrics; ``mxlib.cases`` named corner cases;
``mxlib.workbook``   what the notebooks call (pipeline steps, studies, explorers, checks, figures, the runner);
``mxlib.cli``        the notebooks' code paths as commands; ``mxlib.bench`` GPU benchmarks.
"""

__version__ = "0.1.0"
