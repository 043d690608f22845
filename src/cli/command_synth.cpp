// weightstream synth OUTDIR --arch MODEL_TYPE [--quantize none|fp8-block] [...]
#include <cstdio>

#include "cli/command.hpp"
#include "weightstream/error.hpp"
#include "weightstream/model.hpp"
#include "weightstream/synth.hpp"

namespace weightstream::cli {

namespace {
struct SynthFlags {
  std::string directory;
  SynthOptions options;
  std::string dtype = "bf16";
  std::string size;
  std::string quantize = "none";
  bool json = false;
};
}  // namespace

void add_synth_command(CLI::App& app) {
  auto flags = std::make_shared<SynthFlags>();
  auto* command = app.add_subcommand("synth", "Write a synthetic checkpoint shaped like a Hugging Face model, from a seed");
  command->add_option("outdir", flags->directory, "Directory to write (created if missing)")->required();
  std::vector<std::string> arches;
  for (const Architecture& architecture : architectures()) arches.emplace_back(architecture.model_type);
  command->add_option("--arch", flags->options.arch,
                      supported_model_types() + " (default llama); deepseek_v3, kimi_k2, glm4_moe and qwen3_next "
                      "with MTP layers (--mtp-layers)")
      ->check(CLI::IsMember(arches));
  command->add_option("--quantize", flags->quantize,
                      "none, or fp8-block: F8_E4M3 linear weights with F32 weight_scale_inv per 128x128 block, "
                      "as DeepSeek-V3 ships them (default none)")
      ->check(CLI::IsMember({"none", "fp8-block"}));
  command->add_flag("--block-aligned", flags->options.block_aligned,
                    "Shape the model as --quantize fp8-block does (heads of 128, inner sizes multiples of 512) "
                    "with unquantized weights: the BF16 checkpoint pushed into an FP8 model of the same flags");
  command->add_option("--vocab", flags->options.vocab, "Vocabulary size (default 4096)")->check(CLI::Range(1, 1 << 20));
  command->add_option("--experts", flags->options.experts, "Routed experts of MoE families (default 8)")
      ->check(CLI::Range(1, 65536));
  command->add_option("--mtp-layers", flags->options.mtp_layers,
                      "MTP layers of families that have them (default 1; 0: a checkpoint without them)")
      ->check(CLI::Range(0, 16));
  auto* layers =
      command->add_option("--layers", flags->options.layers, "Decoder layers (default 2)")->check(CLI::Range(1, 4096));
  // Checked by synthesize_checkpoint alone, so that the help, the rule and the message agree.
  command->add_option("--hidden", flags->options.hidden, "Hidden size: a multiple of 32 from 64 to 65536 (default 256)");
  command->add_option("--shards", flags->options.shards, "Shard files (default 2)")->check(CLI::Range(1, 10000));
  command->add_option("--seed", flags->options.seed, "Random seed (default 0)");
  command->add_option("--dtype", flags->dtype, "bf16, f16 or f32 (default bf16)")->check(CLI::IsMember({"bf16", "f16", "f32"}));
  command->add_option("--size", flags->size,
                      "Scale the model to about this many bytes, e.g. 2GiB (more layers, then wider); a size below "
                      "the one-layer model is refused")
      ->excludes(layers);
  command->add_flag("--force", flags->options.replace,
                    "Replace a checkpoint already in OUTDIR (its shards the new one lacks are removed); without it, "
                    "such a folder is refused");
  command->add_flag("--json", flags->json, "Print JSON: directory, arch, tensors, bytes, files, layers");
  command->callback([flags] {
    auto options = flags->options;
    options.dtype = flags->dtype == "f16" ? Dtype::kF16 : flags->dtype == "f32" ? Dtype::kF32 : Dtype::kBF16;
    if (!flags->size.empty()) options.target_bytes = parse_size(flags->size, "--size");
    if (flags->quantize == "fp8-block") options.quantize = SynthOptions::Quantization::kFp8Block;
    auto result = synthesize_checkpoint(flags->directory, options);
    if (flags->json) {
      print_json({{"directory", flags->directory},
                  {"arch", options.arch},
                  {"tensors", result.tensors},
                  {"bytes", result.bytes},
                  {"files", result.files},
                  {"layers", result.config.num_hidden_layers}});
    } else {
      std::printf("wrote %s: %s checkpoint, %s, %s, %s in %s\n", flags->directory.c_str(), options.arch.c_str(),
                  counted(static_cast<uint64_t>(result.config.num_hidden_layers), "layer").c_str(),
                  counted(result.tensors, "tensor").c_str(), format_size(result.bytes).c_str(),
                  counted(result.files.size(), "file").c_str());
    }
  });
}

}  // namespace weightstream::cli
