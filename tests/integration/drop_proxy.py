"""An HTTP/1.1 proxy in front of an S3 endpoint (a reviewer's, kept as a test helper): it forwards every request,
and for the first ``drops`` requests that ``match`` (method, path, headers) it forwards the request, reads the
server's answer, then closes the client's connection without sending it: the request took effect, the client never
heard. With ``cut=True`` it sends the answer's head and half its body instead, then closes (a server killed while it
answered); with ``hang=s`` it sends nothing and holds the connection open for s seconds (a peer gone without a
reset: a network partition, a paused machine); with ``reset=True`` it resets the connection on reading the request,
forwarding nothing (a server killed as the request reached it); with ``empty=True`` it answers a listing as if it
held no object (a store whose listing misses what it acknowledged).
``DropProxy(upstream_port, match, drops=1).port``."""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import struct
import threading
import time
from collections.abc import Callable


class DropProxy:
    def __init__(
        self,
        upstream_port: int,
        match: Callable[[str, str, dict[str, str]], bool],
        drops: int = 1,
        cut: bool = False,
        hang: float = 0.0,
        reset: bool = False,
        empty: bool = False,
    ):
        self.upstream_port = upstream_port
        self.cut, self.hang, self.reset, self.empty = cut, hang, reset, empty
        self.match = match
        self.drops_left = drops
        self.dropped: list[str] = []
        self.seen: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            c, _ = self.sock.accept()
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _take(self, method: str, path: str, hd: dict[str, str], what: str) -> bool:
        """Whether this request is one to drop (noted in ``seen`` and, if dropped, ``dropped``)."""
        with self.lock:
            drop = self.drops_left > 0 and self.match(method, path, hd)
            self.seen.append((method, path, what if drop else "forwarded"))
            if drop:
                self.drops_left -= 1
                self.dropped.append(f"{method} {path} -> {what}")
            return drop

    def _serve(self, c: socket.socket) -> None:
        f = c.makefile("rb")
        rst = False
        up = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                method, path, _ = line.decode().split(" ", 2)
                headers: list[tuple[str, str]] = []
                while True:
                    h = f.readline()
                    if h in (b"\r\n", b"\n", b""):
                        break
                    k, v = h.decode().split(":", 1)
                    headers.append((k.strip(), v.strip()))
                hd = {k.lower(): v for k, v in headers}
                body = b""
                if "content-length" in hd:
                    body = f.read(int(hd["content-length"]))
                elif hd.get("transfer-encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(f.readline().split(b";")[0], 16)
                        if size == 0:
                            f.readline()
                            break
                        chunks.append(f.read(size))
                        f.readline()
                    body = b"".join(chunks)
                    headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
                    headers.append(("Content-Length", str(len(body))))
                if self.reset and self._take(method, path, hd, "reset, not forwarded"):
                    # An RST, not a FIN: no linger, and no shutdown (which would send a FIN first); the file made of
                    # the socket holds its descriptor open until it is closed too.
                    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    f.close()
                    rst = True
                    return
                up.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                for k, v in headers:
                    up.putheader(k, v)
                up.endheaders(body or None)
                r = up.getresponse()
                data = r.read()
                how = "cut" if self.cut else "held" if self.hang else "emptied" if self.empty else "dropped"
                drop = not self.reset and self._take(method, path, hd, f"{r.status} (answer {how})")
                if drop and self.empty:  # the listing's objects and folders left out, the answer sent
                    data = re.sub(rb"<(Contents|CommonPrefixes)>.*?</\1>", b"", data, flags=re.S)
                    data = re.sub(rb"<KeyCount>\d+</KeyCount>", b"<KeyCount>0</KeyCount>", data)
                    drop = False
                if drop and self.hang:
                    time.sleep(self.hang)  # not a byte, no reset: the client has only its own timeouts
                    return
                if drop and not self.cut:
                    return  # the finally closes the client's connection: no answer at all
                out = [f"HTTP/1.1 {r.status} {r.reason}\r\n".encode()]
                for k, v in r.getheaders():
                    if k.lower() in ("transfer-encoding", "content-length"):
                        continue
                    out.append(f"{k}: {v}\r\n".encode())
                if method == "HEAD":
                    cl = r.getheader("Content-Length")
                    if cl is not None:
                        out.append(f"Content-Length: {cl}\r\n".encode())
                else:
                    out.append(f"Content-Length: {len(data)}\r\n".encode())
                out.append(b"\r\n")
                if drop:  # cut: the head and half the body, then the connection closes (the finally)
                    c.sendall(b"".join(out) + data[: len(data) // 2])
                    return
                c.sendall(b"".join(out) + (b"" if method == "HEAD" else data))
        except (OSError, ValueError):
            return
        finally:
            up.close()
            if not rst:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
            c.close()


def put_create(pattern: str) -> Callable[[str, str, dict[str, str]], bool]:
    """Matches a put-if-absent (``If-None-Match: *``) whose path matches ``pattern``."""
    rx = re.compile(pattern)
    return lambda method, path, h: method == "PUT" and h.get("if-none-match") == "*" and rx.search(path) is not None
