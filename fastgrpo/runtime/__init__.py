"""What every layer uses: errors, metrics, host memory, worker processes."""
