"""felix-fl: federated learning under churn, class imbalance and skewed participation."""

from felix.cpu_kernels import pin as _pin_cpu_kernels

_pin_cpu_kernels()  # before torch's first CPU operation: one set of kernels on every x86-64 host

__version__ = "0.1.0"
