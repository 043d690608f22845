#pragma once
// The kinds of source that source.cpp's open_source() chooses among, each in its own file.

#include <memory>
#include <string>

#include "weightstream/source.hpp"

namespace weightstream {

/// The serving peers of a peer:// URI (peers_source.cpp), connected at the first use.
std::unique_ptr<Source> peers_source(std::string uri, PeerPullOptions options);

}  // namespace weightstream
