// The rule every listener keeps on its token (weightstream/transfer.hpp), checked where the
// listeners take it: net/handshake.hpp.
#include "net/handshake.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream {

void require_listener_token(const std::string& token, bool open_without_token, const std::string& listener) {
  transfer::check_listener_token(token, open_without_token, listener);
}

}  // namespace weightstream
