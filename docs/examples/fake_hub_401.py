# A local HTTP endpoint that answers every POST with 401, as the Hub does for a missing or invalid token.
import http.server
import json
import sys


class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.dumps({"error": "Invalid username or password."}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
