from setuptools import find_packages, setup

MPI = ["mpi4py>=3.1", "mpich"]
# the oracles and tools the tests use (the MPI tests spawn the mpich wheel's mpiexec)
# onnxscript: torch's own exporter of opset 23 and later (dynamo), for the tests of such exports
# pytest-xdist: the suite runs on two worker processes (-n 2), in about half the time on two CPUs
# expecttest: imported by torch's OpInfo database (torch.testing._internal), which test_torch_opinfo.py reads
# torchvision 0.28.0: the release built for torch 2.13, whose models test_torchvision_models.py trains (PyPI's
# wheel links torch's CUDA build: with the CPU build its C ops fail to load, and the test declares them away)
# onnxruntime >= 1.32: the oracle the suite was checked against (1.23, the last for Python 3.10, reads no
# model of IR version 12 or later: 861 of the suite's comparisons failed there)
TEST = ["pytest>=7", "pytest-timeout", "pytest-xdist", "torch==2.13.0", "onnxruntime>=1.32",
        "flatbuffers>=23", "onnxscript", "expecttest", "torchvision==0.28.0", "transformers==5.25.0",
        "timm==1.0.31", *MPI]

setup(
    name="onnxtrain",
    version="0.1.0",
    description=(
        "Train ONNX models with numpy: legacy TrainingSession, autodiff to standard ONNX, on-device API"
    ),
    packages=find_packages(include=["onnxtrain", "onnxtrain.*"]),
    package_data={"onnxtrain": ["data/*.npz"]},
    python_requires=">=3.10",
    # typing_extensions >= 4.16: older ones import asyncio (and ssl) for onnx.helper's deprecated functions;
    # onnx >= 1.18: its float4 type (1.16-1.17 fail at import); protobuf 6.31 with onnx 1.18 trained the main
    # job, 5.29 failed in a session; matplotlib 3.7 is built for numpy 1 (the plot failed);
    # ml_dtypes (imported by onnx) 0.7.0 takes 7.8 MiB of RSS and 0.55 s to import against 0.6.0's 2.7 MiB and
    # 5 ms: every onnxtrain process pays it (bench/HISTORY.md, 2026-12-05 18:25 UTC)
    install_requires=["numpy>=2", "onnx>=1.18", "protobuf>=6.31", "PyYAML>=6", "tqdm>=4", "matplotlib>=3.8.4",
                      "typing_extensions>=4.16", "ml_dtypes!=0.7.0"],
    extras_require={"mpi": MPI, "test": TEST, "all": MPI + TEST},
    entry_points={"console_scripts": ["onnxtrain=onnxtrain.cli:main"]},
)
