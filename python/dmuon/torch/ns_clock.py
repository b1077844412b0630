"""The Newton–Schulz time of one DMuon step (DMuon.last_stats["ns_s"]). On the CPU the engines compute before they
return, so host time is Newton–Schulz time; on CUDA their calls only enqueue work on torch's current stream, so the
clock records an event there before and after each interval and reads the device time between them (waiting for the
last one) only when asked, after the step: the step itself never waits for the device."""

import time

import torch


class NsClock:
    def __init__(self):
        self._host_s = 0.0
        self._intervals = []  # (start, end) CUDA events
        self._seconds = None  # the total, once read

    def start(self, device):
        """The start of an interval of work on `device` (a torch.device), for stop()."""
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(device))
            return device, event
        return time.perf_counter()

    def stop(self, started):
        """Ends the interval start() began."""
        if isinstance(started, float):
            self._host_s += time.perf_counter() - started
            return
        device, start = started
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(device))
        self._intervals.append((start, end))

    def seconds(self):
        """Host seconds plus the device seconds between each interval's events (waits for the last)."""
        if self._seconds is None:
            device_s = 0.0
            for start, end in self._intervals:
                end.synchronize()
                device_s += start.elapsed_time(end) / 1e3
            self._seconds = self._host_s + device_s
            self._intervals = []
        return self._seconds

    def __deepcopy__(self, memo):
        """A copy (of a copied DMuon) holds the total: CUDA events are not copied."""
        copy = NsClock()
        copy._seconds = self.seconds()
        return copy
