"""felix-fl: federated learning under churn, class imbalance and skewed participation."""

__version__ = "0.1.0"
