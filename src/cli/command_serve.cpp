// weightstream serve URI --listen HOST:PORT [--tp-size T --tp-rank R ...] [--device cpu|cuda:N]
//                    --token-stdin | (WEIGHTSTREAM_PEER_TOKEN) | --open-without-token
//                    [--metrics-listen HOST:PORT]
// Loads one rank's parameters into host memory (or a GPU's, served through a CUDA-aware UCX)
// and publishes them to pullers (peer://) until SIGINT or SIGTERM. Prints one line with the
// checkpoint's content digest and its address once ready.
#include <signal.h>

#include <cstdio>
#include <iostream>

#include "cli/metrics.hpp"
#include "cli/peer_flags.hpp"
#include "weightstream/error.hpp"
#include "weightstream/transfer.hpp"

namespace weightstream::cli {
namespace {

struct ServeFlags {
  std::string uri;
  std::string listen = "127.0.0.1:0";
  std::string device = "cpu";
  LayoutFlags layout;
  bool token_stdin = false;
  bool open_without_token = false;
  StreamFlags stream;
  MetricsFlags metrics;
};

}  // namespace

void add_serve_command(CLI::App& app) {
  auto flags = std::make_shared<ServeFlags>();
  auto* command = app.add_subcommand("serve", "Load a rank's parameters and publish them to peers (peer://) until SIGINT/SIGTERM");
  command->add_option("uri", flags->uri, "Checkpoint with config.json: a directory, file://, s3://, gs:// or az://")->required();
  command->add_option("--listen", flags->listen, "HOST:PORT to listen on (default 127.0.0.1:0, a free loopback port)");
  add_layout_flags(*command, flags->layout);
  command->add_option("--device", flags->device,
                      "Where the served parameters live: cpu or cuda:N (GPU memory needs a CUDA-aware UCX; default cpu)");
  auto* token_stdin = command->add_flag(
      "--token-stdin", flags->token_stdin,
      "Read the token pullers must prove from the first line of stdin (else WEIGHTSTREAM_PEER_TOKEN); required "
      "unless --open-without-token");
  command->add_flag("--open-without-token", flags->open_without_token,
                    "Serve any puller, with no token (warned about on stderr); without it, serve refuses to start "
                    "without a token")
      ->excludes(token_stdin);
  add_stream_flags(*command, flags->stream);
  add_metrics_flags(*command, flags->metrics);
  command->callback([flags] {
    // Blocked before any thread starts, so every thread inherits the mask and the signals
    // reach sigwait below.
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
    // Before the load, so that a scrape sees the server start; its threads inherit the mask.
    std::unique_ptr<MetricsEndpoint> metrics = start_metrics(flags->metrics);

    Options options = resolve_options(flags->stream);
    PeerServeOptions serve;
    serve.listen = flags->listen;
    serve.open_without_token = flags->open_without_token;
    if (flags->token_stdin) {
      serve.token = token_from_stdin();
    } else if (!serve.open_without_token) {
      serve.token = options.peer_token;
    }
    // Refused here, before the load, as the server would refuse it once loaded.
    require_listener_token(serve.token, serve.open_without_token, "serve --listen " + serve.listen);
    Checkpoint checkpoint = Checkpoint::open(flags->uri, options);
    ModelLayout layout = checkpoint_layout(checkpoint, flags->layout, parse_device(flags->device));
    Publication cold_series = publish_load(
        metrics.get(),
        checkpoint_load_record(checkpoint, load_layout(layout, checkpoint, LoadMode::kCold, options.stream).stream),
        flags->metrics);

    const Parallelism parallel{flags->layout.tp_size.value_or(1), flags->layout.tp_rank.value_or(0),
                               flags->layout.ep_size, flags->layout.ep_rank};
    // Reads the whole checkpoint once more (every rank's tensors): the content digest.
    PeerServeInfo info = peer_serve_info(checkpoint, parallel,
                                         flags->layout.quantize == "fp8" ? Processing::kFp8PerTensor : Processing::kNone,
                                         options.stream);
    const std::string content = info.content_digest;
    PeerServer server(layout, std::move(info), serve);
    Publication server_series = publish(metrics.get(), [&server] { return peer_server_series(server.stats()); });
    uint64_t bytes = 0;
    for (const Parameter& parameter : layout.parameters()) bytes += parameter.bytes();
    std::printf("serving %s of %s (%zu parameters, %s, version %llu, content digest %s) at peer://%s\n",
                layout.description().c_str(), checkpoint.uri().c_str(), layout.parameters().size(),
                format_size(bytes).c_str(), static_cast<unsigned long long>(server.version()), content.c_str(),
                server.address().c_str());
    std::fflush(stdout);
    int received = 0;
    sigwait(&stop_signals, &received);
    std::fprintf(stderr, "weightstream: serve stopped by %s\n", received == SIGINT ? "SIGINT" : "SIGTERM");
  });
}

}  // namespace weightstream::cli
