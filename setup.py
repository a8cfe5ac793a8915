from setuptools import find_packages, setup

setup(
    name="seqpipe",
    version="0.1.0",
    description="Pipeline parallelism for PyTorch nn.Sequential models: local and distributed",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    packages=find_packages(include=["seqpipe", "seqpipe.*"]),
    package_data={"seqpipe": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.8", "typing-extensions>=4.6", "numpy"],  # numpy: torch warns without it
    extras_require={"test": ["pytest>=7", "pytest-benchmark>=4", "numpy",
                             # GPT-2 from a small config (tests/graph_models.py)
                             "transformers==5.24.0"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Typing :: Typed",
    ],
)
