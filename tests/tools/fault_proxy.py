#!/usr/bin/env python3
"""A fault-injecting HTTP reverse proxy for testing the object-store backends.

It listens on a loopback port and forwards every request to one upstream server (moto's
S3 server, fake-gcs-server with --flavor gcs, or an Azure Blob emulator with --flavor azure), and can spoil the next N matching responses in the
ways real object stores and networks do:

  reset     send the headers and half of the body, then reset the connection (RST)
  truncate  send the headers and half of the body, then close the connection cleanly
  overlong  send more body bytes than the range asked for (Content-Length agrees with them)
  badrange  answer with a Content-Range that is not the range asked for
  stall     send the headers and half of the body, then stop sending for --stall seconds
  corrupt   flip bytes in the body, keeping its length
  503       503 SlowDown with an S3 XML error body (a "burst" when count > 1)
  429       429 TooManyRequests
  500       500 InternalError
  403       403 AccessDenied
  404       404 NoSuchKey
With --flavor gcs the errors are the JSON API's documents instead (503 backendError,
429 rateLimitExceeded, 500 internalError, 403 forbidden, 404 notFound) and the request id
travels in x-guploader-uploadid. With --flavor azure they are the Blob service's XML
documents (503 ServerBusy, 429 ServerBusy, 500 InternalError, 403 AuthorizationPermissionMismatch,
404 BlobNotFound), with the code in x-ms-error-code and the request id in x-ms-request-id.

Control (plain GETs, never forwarded):
  /__fault__/plan?mode=M&count=N[&method=GET][&path=SUBSTRING]   arm a fault
  /__fault__/clear                                               disarm, zero the counters
  /__fault__/stats                                               JSON counters

Usage: fault_proxy.py --upstream http://127.0.0.1:PORT [--flavor s3|gcs|azure] [--port 0] [--lifetime SECONDS]
The first line on stdout is "PORT <n>". The proxy stops on SIGTERM, after --lifetime
seconds, or (with --watch-stdin) when its stdin closes, whichever comes first. It binds to 127.0.0.1 only.
"""

import argparse
import http.client
import http.server
import json
import os
import socket
import struct
import sys
import threading
import time
import urllib.parse

MODES = {"reset", "truncate", "overlong", "badrange", "stall", "corrupt", "503", "429", "500", "403", "404"}
ERRORS = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "429": (429, "TooManyRequests", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "403": (403, "AccessDenied", "Access Denied"),
    "404": (404, "NoSuchKey", "The specified key does not exist."),
}
GCS_ERRORS = {
    "503": (503, "backendError", "Backend Error"),
    "429": (429, "rateLimitExceeded", "The rate of change requests to the object is too high."),
    "500": (500, "internalError", "Internal Error"),
    "403": (403, "forbidden", "Caller does not have storage.objects.get access to the object."),
    "404": (404, "notFound", "No such object."),
}
AZURE_ERRORS = {
    "503": (503, "ServerBusy", "The server is currently unable to receive requests. Please retry your request."),
    "429": (429, "ServerBusy", "Operations per second is over the account limit."),
    "500": (500, "InternalError", "The server encountered an internal error. Please retry the request."),
    "403": (403, "AuthorizationPermissionMismatch", "This request is not authorized to perform this operation using this permission."),
    "404": (404, "BlobNotFound", "The specified blob does not exist."),
}


class Plan:
    """The armed fault and the counters, shared by all handler threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.clear()

    def clear(self):
        self.mode = None
        self.remaining = 0
        self.method = None
        self.path = None
        self.requests = 0
        self.faults = 0
        self.by_method = {}
        self.serial = 0

    def take(self, method, path):
        """Counts one forwarded request; returns the fault to apply to it, if any."""
        with self.lock:
            self.requests += 1
            self.by_method[method] = self.by_method.get(method, 0) + 1
            self.serial += 1
            if self.remaining <= 0 or self.mode is None:
                return None, self.serial
            if self.method and self.method != method:
                return None, self.serial
            if self.path and self.path not in path:
                return None, self.serial
            self.remaining -= 1
            self.faults += 1
            return self.mode, self.serial


PLAN = Plan()
OPTIONS = None


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so the client's connection reuse is exercised

    def log_message(self, format, *args):  # quiet: the tests read stdout for the port only
        pass

    def do_GET(self):
        if self.path.startswith("/__fault__/"):
            self.control()
        else:
            self.forward()

    def do_HEAD(self):
        self.forward()

    def do_PUT(self):
        self.forward()

    def do_POST(self):
        self.forward()

    def do_DELETE(self):
        self.forward()

    # -- control ----------------------------------------------------------------------

    def control(self):
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        status, body = 200, {}
        if url.path == "/__fault__/plan":
            mode = query.get("mode")
            if mode not in MODES:
                status, body = 400, {"error": "unknown mode %r" % mode}
            else:
                with PLAN.lock:
                    PLAN.mode = mode
                    PLAN.remaining = min(int(query.get("count", "1")), 1000)
                    PLAN.method = query.get("method")
                    PLAN.path = query.get("path")
                body = {"armed": mode}
        elif url.path == "/__fault__/clear":
            with PLAN.lock:
                PLAN.clear()
        elif url.path == "/__fault__/stats":
            with PLAN.lock:
                body = {"requests": PLAN.requests, "faults": PLAN.faults, "by_method": PLAN.by_method,
                        "armed_remaining": PLAN.remaining}
        else:
            status, body = 404, {"error": "unknown control path"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # -- forwarding -------------------------------------------------------------------

    def forward(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length > 0 else b""
        mode, serial = PLAN.take(self.command, self.path)
        request_id = "FAULTPROXY%08d" % serial
        if mode in ERRORS:
            if OPTIONS.flavor == "gcs":
                self.send_gcs_error_document(*GCS_ERRORS[mode], request_id)
            elif OPTIONS.flavor == "azure":
                self.send_azure_error_document(*AZURE_ERRORS[mode], request_id)
            else:
                self.send_error_document(*ERRORS[mode], request_id)
            return
        upstream = http.client.HTTPConnection(OPTIONS.upstream_host, OPTIONS.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            payload = response.read()
            status = response.status
            # A HEAD has no body but announces the object's length: pass that on.
            announced = int(response.getheader("Content-Length") or len(payload))
            reply_headers = [(k, v) for k, v in response.getheaders()
                             if k.lower() not in ("content-length", "connection", "transfer-encoding", "keep-alive",
                                                  "server", "date")]
        finally:
            upstream.close()
        is_body = self.command != "HEAD" and 200 <= status < 300 and len(payload) > 0
        if not is_body or mode is None:
            self.reply(status, reply_headers, payload, announced if self.command == "HEAD" else len(payload))
            return
        half = len(payload) // 2
        if mode == "reset":
            self.reply_headers(status, reply_headers, len(payload))
            self.wfile.write(payload[:half])
            self.wfile.flush()
            self.abort_connection()
        elif mode == "truncate":
            self.reply_headers(status, reply_headers, len(payload))
            self.wfile.write(payload[:half])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        elif mode == "overlong":
            extra = b"\0" * 4096
            self.reply(status, reply_headers, payload + extra, len(payload) + len(extra))
        elif mode == "badrange":
            changed = [(k, v) for k, v in reply_headers if k.lower() != "content-range"]
            changed.append(("Content-Range", "bytes 1-%d/%d" % (len(payload), len(payload) + 1)))
            self.reply(status, changed, payload, len(payload))
        elif mode == "stall":
            self.reply_headers(status, reply_headers, len(payload))
            self.wfile.write(payload[:half])
            self.wfile.flush()
            deadline = time.monotonic() + OPTIONS.stall
            while time.monotonic() < deadline:  # bounded: the proxy never waits longer than --stall
                time.sleep(0.05)
            self.abort_connection()
        elif mode == "corrupt":
            spoiled = bytearray(payload)
            for i in range(0, len(spoiled), max(1, len(spoiled) // 16)):
                spoiled[i] ^= 0x5A
            self.reply(status, reply_headers, bytes(spoiled), len(spoiled))

    def reply_headers(self, status, headers, content_length):
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(content_length))
        self.end_headers()

    def reply(self, status, headers, payload, content_length):
        self.reply_headers(status, headers, content_length)
        if self.command != "HEAD":
            self.wfile.write(payload)

    def send_error_document(self, status, code, message, request_id):
        data = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>%s</Code><Message>%s</Message>'
                '<RequestId>%s</RequestId></Error>' % (code, message, request_id)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("x-amz-request-id", request_id)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_gcs_error_document(self, status, reason, message, request_id):
        data = json.dumps({"error": {"code": status, "message": message,
                                     "errors": [{"domain": "global", "reason": reason, "message": message}]}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("x-guploader-uploadid", request_id)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_azure_error_document(self, status, code, message, request_id):
        data = ('<?xml version="1.0" encoding="utf-8"?><Error><Code>%s</Code><Message>%s\nRequestId:%s\n'
                'Time:2026-01-01T00:00:00.0000000Z</Message></Error>' % (code, message, request_id)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("x-ms-request-id", request_id)
        self.send_header("x-ms-error-code", code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def abort_connection(self):
        """Closes with a TCP reset (SO_LINGER 0), as a crashed peer or middlebox does."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def main():
    global OPTIONS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="upstream URL, http://127.0.0.1:PORT")
    parser.add_argument("--flavor", choices=("s3", "gcs", "azure"), default="s3", help="whose error documents to send")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free port)")
    parser.add_argument("--stall", type=float, default=5.0, help="seconds a 'stall' fault holds the body")
    parser.add_argument("--lifetime", type=float, default=900.0, help="seconds before the proxy stops by itself")
    parser.add_argument("--watch-stdin", action="store_true", help="stop when stdin reaches end of file")
    OPTIONS = parser.parse_args()
    upstream = urllib.parse.urlsplit(OPTIONS.upstream)
    if upstream.hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit("fault_proxy.py: the upstream must be a loopback address, not %r" % upstream.hostname)
    OPTIONS.upstream_host = upstream.hostname
    OPTIONS.upstream_port = upstream.port or 80

    server = Server(("127.0.0.1", OPTIONS.port), Handler)
    print("PORT %d" % server.server_address[1], flush=True)

    def stop_when_stdin_closes():
        try:
            while sys.stdin.buffer.read(1024):
                pass
        except (OSError, ValueError):
            pass
        server.shutdown()

    if OPTIONS.watch_stdin:
        threading.Thread(target=stop_when_stdin_closes, daemon=True).start()
    threading.Timer(OPTIONS.lifetime, server.shutdown).start()
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        # Exit without waiting for the lifetime timer thread.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
