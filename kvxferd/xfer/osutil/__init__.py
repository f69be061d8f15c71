"""Operating-system helpers of the data plane's threads: the fd table, thread names, a cheap waker."""
