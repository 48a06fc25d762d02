"""A delaying TCP relay on loopback: our kernels have no netem, so latency is added in user space.

`DelayRelay(target).start()` listens on 127.0.0.1:<port> and forwards every connection to
`target`. Each chunk it reads in either direction is held until `delay_s` after it arrived,
and sending is paced to `bandwidth_bps` (0: unlimited). Both can change while connections
are open (`set(...)`), so a relay can sit in the path from the start in pass-through mode
and degrade the link only during the fault. Bytes are never dropped or reordered; the
counters say how many went each way.

Limit: a process reaches the relay only if it connects to the relay's address. gloo's
peers connect straight to the addresses they publish through the store, so for
torch.distributed only the MASTER_PORT store connection can be pointed here (see
faults.py and the network_degradation scenario).
"""
from __future__ import annotations

import queue
import socket
import threading
import time

CHUNK = 64 * 1024


class DelayRelay:
    def __init__(self, target: tuple[str, int], delay_s: float = 0.0, bandwidth_bps: float = 0.0,
                 listen: tuple[str, int] = ("127.0.0.1", 0)):
        self.target = target
        self.delay_s, self.bandwidth_bps = delay_s, bandwidth_bps
        self._listen_addr = listen
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.bytes_up = self.bytes_down = 0  # client->target, target->client
        self.connections = 0
        self.errors: list[str] = []

    @property
    def address(self) -> tuple[str, int]:
        assert self._sock is not None, "relay not started"
        return self._sock.getsockname()

    def set(self, delay_s: float | None = None, bandwidth_bps: float | None = None) -> None:
        if delay_s is not None:
            self.delay_s = delay_s
        if bandwidth_bps is not None:
            self.bandwidth_bps = bandwidth_bps

    def start(self) -> "DelayRelay":
        self._sock = socket.create_server(self._listen_addr, reuse_port=False)
        self._sock.settimeout(0.2)
        self._spawn(self._accept_loop)
        return self

    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError as e:
                self.errors.append(f"connect {self.target}: {e}")
                client.close()
                continue
            for s in (client, upstream):
                s.settimeout(None)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns += [client, upstream]
                self.connections += 1
            self._pipe(client, upstream, "up")
            self._pipe(upstream, client, "down")

    def _pipe(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        held: queue.Queue = queue.Queue()
        self._spawn(self._reader, src, held)
        self._spawn(self._writer, dst, held, direction)

    def _reader(self, src: socket.socket, held: queue.Queue) -> None:
        while True:
            try:
                data = src.recv(CHUNK)
            except OSError:
                data = b""
            held.put((time.monotonic(), data))
            if not data:
                return

    def _writer(self, dst: socket.socket, held: queue.Queue, direction: str) -> None:
        while True:
            arrived, data = held.get()
            wait = arrived + self.delay_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if not data:  # the source closed: pass the half-close on
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            try:
                dst.sendall(data)
            except OSError as e:
                self.errors.append(f"send {direction}: {e}")
                return
            with self._lock:
                if direction == "up":
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
            if self.bandwidth_bps > 0:
                time.sleep(len(data) * 8 / self.bandwidth_bps)

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
        with self._lock:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
        for t in self._threads:
            t.join(timeout=2)

    def __enter__(self) -> "DelayRelay":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
