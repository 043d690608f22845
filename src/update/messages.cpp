// The update protocol's messages on a connection (wire.hpp): a frame of the shared header
// (net/frame.hpp) and the message's body, a shm bucket's descriptor riding with the header.
#include <string>
#include <vector>

#include "update/wire.hpp"

namespace weightstream::transfer {

void send_message(Connection& connection, const Message& message, std::chrono::milliseconds timeout, int pass_fd) {
  const std::vector<std::byte> body = encode_body(message);
  const auto header = encode_header(message.type, body.size());
  connection.send_frame(header, body, timeout, std::string(message_type_name(message.type)) + " message", pass_fd);
}

Received receive_message(Connection& connection, std::chrono::milliseconds timeout, const std::string& awaiting) {
  std::array<std::byte, kHeaderBytes> header_bytes;
  Received received;
  connection.receive_with_fd(header_bytes, timeout, awaiting, received.fd);
  const FrameHeader header = parse_header(header_bytes, connection.peer());
  std::vector<std::byte> body(header.length);
  connection.receive_bytes(body, timeout, std::string(message_type_name(header.type)) + " message body");
  const auto parse_started = std::chrono::steady_clock::now();
  received.message = parse_body(header.type, body, connection.peer());
  received.parse_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - parse_started).count();
  return received;
}

}  // namespace weightstream::transfer
