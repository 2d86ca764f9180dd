// op_dump: every graph tensor of one llama_decode, written as raw bytes plus an index, for
// bench/op_diff.py (which runs llamapy's kernels on these inputs and compares bit for bit).
// The counterpart of llama.cpp's examples/eval-callback, which prints only a few values.
//
// Build against the static libraries `bench/llama_cpp.py build` leaves (B: its build folder,
// L: the llama.cpp sources):
//   c++ -O2 -I$L/include -I$L/ggml/include bench/op_dump.cpp -o op_dump $B/src/libllama.a
//       $B/ggml/src/libggml.a $B/ggml/src/libggml-cpu.a $B/ggml/src/libggml-base.a -ldl -lm -fopenmp -lpthread
// Run: op_dump MODEL OUTDIR FLASH_ATTN(0|1) CACHE(f16|f32) N_UBATCH TOKEN...   (-t 1, n_ctx 256)
//      OP_DUMP_ALL_LOGITS=1: every token's logits (llama-perplexity's many-row output MUL_MAT)
// OP_DUMP_SEQS=n (environment): the tokens split evenly into n sequences (ids 0..n-1, positions
// from 0 each), one KV stream each (kv_unified off, as llama-perplexity runs: each sequence's
// cells from 0 of its own stream), n_ctx 256 per sequence.
#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

struct dump_state {
    std::string dir;
    int n = 0;
    FILE * index = nullptr;
};

static bool on_tensor(struct ggml_tensor * t, bool ask, void * user) {
    auto * st = (dump_state *) user;
    if (ask) {
        return true;  // every tensor
    }
    const size_t nbytes = ggml_nbytes(t);
    std::vector<char> buf(nbytes);
    ggml_backend_tensor_get(t, buf.data(), 0, nbytes);
    char path[1024];
    snprintf(path, sizeof path, "%s/%04d.bin", st->dir.c_str(), st->n);
    FILE * f = fopen(path, "wb");
    fwrite(buf.data(), 1, nbytes, f);
    fclose(f);
    // index: number, name, op, type, ne0..3, nb0..3, src0 name, src1 name
    fprintf(st->index, "%04d\t%s\t%s\t%s\t%lld,%lld,%lld,%lld\t%zu,%zu,%zu,%zu\t%s\t%s\n", st->n, t->name, ggml_op_desc(t),
            ggml_type_name(t->type), (long long) t->ne[0], (long long) t->ne[1], (long long) t->ne[2],
            (long long) t->ne[3], t->nb[0], t->nb[1], t->nb[2], t->nb[3], t->src[0] ? t->src[0]->name : "-",
            t->src[1] ? t->src[1]->name : "-");
    st->n++;
    return true;
}

int main(int argc, char ** argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s MODEL OUTDIR FLASH_ATTN(0|1) CACHE(f16|f32) N_UBATCH TOKEN...\n", argv[0]);
        return 2;
    }
    dump_state st;
    st.dir = argv[2];
    std::vector<llama_token> tokens;
    for (int i = 6; i < argc; i++) {
        tokens.push_back(atoi(argv[i]));
    }
    st.index = fopen((st.dir + "/index.tsv").c_str(), "w");
    if (!st.index) {
        fprintf(stderr, "cannot write %s/index.tsv\n", argv[2]);
        return 1;
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        return 1;
    }
    const char * seqs_env = getenv("OP_DUMP_SEQS");
    const int n_seq = seqs_env ? atoi(seqs_env) : 1;
    if (n_seq < 1 || tokens.size() % n_seq) {
        fprintf(stderr, "OP_DUMP_SEQS must divide the number of tokens\n");
        return 2;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 256 * n_seq;
    cp.n_batch = tokens.size() > 256 ? tokens.size() : 256;
    cp.n_seq_max = n_seq;
    cp.kv_unified = false;
    cp.n_ubatch = atoi(argv[5]);
    cp.n_threads = cp.n_threads_batch = 1;
    cp.flash_attn_type = atoi(argv[3]) ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = cp.type_v = strcmp(argv[4], "f32") == 0 ? GGML_TYPE_F32 : GGML_TYPE_F16;
    cp.cb_eval = on_tensor;
    cp.cb_eval_user_data = &st;
    llama_context * ctx = llama_init_from_model(model, cp);
    // every token's logits (as llama-perplexity asks): result_output is then a many-row MUL_MAT
    // (llamafile's tinyBLAS for a Q8_0 output) instead of the last token's single row
    const bool all_logits = getenv("OP_DUMP_ALL_LOGITS") && atoi(getenv("OP_DUMP_ALL_LOGITS"));
    const int per = (int) tokens.size() / n_seq;
    llama_batch batch = llama_batch_init((int32_t) tokens.size(), 0, 1);
    for (size_t i = 0; i < tokens.size(); i++) {
        batch.token[i] = tokens[i];
        batch.pos[i] = (llama_pos) (i % per);
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = (llama_seq_id) (i / per);
        batch.logits[i] = all_logits || i + 1 == tokens.size();
    }
    batch.n_tokens = (int32_t) tokens.size();
    if (llama_decode(ctx, batch)) {
        fprintf(stderr, "decode failed\n");
        return 1;
    }
    fclose(st.index);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
