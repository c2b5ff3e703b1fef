// Bad input gets its status and a message, and no output is written.
#include <cctype>
#include <functional>
#include <string>

#include "../common/testing.hpp"

using namespace fct;

namespace {

struct Fixture {
  Handle h;
  Tensor logits{DT::BF16, {4, 10}}, targets{DT::I64, {4}}, loss{DT::F32, {}}, lse{DT::F32, {4}}, dl{DT::BF16, {4, 10}};
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  Fixture() {
    fill_logits(logits, 1, false);
    for (int i = 0; i < 4; ++i) targets.set_int(i, i);
    targets.upload();
    for (Tensor* t : {&loss, &lse, &dl}) { t->poison(); t->upload(); }
    out.loss = loss.dl(); out.lse = lse.dl(); out.dlogits = dl.dl();
  }
  fce_status_t call() { return fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0); }
  void expect(fce_status_t want, const char* what) {
    const fce_status_t got = call();
    EXPECT_EQ(got, want) << what << ": " << fce_last_error_message();
    EXPECT_STRNE(fce_last_error_message(), "") << what;
    for (Tensor* t : {&loss, &lse, &dl}) {
      t->download();
      for (uint8_t b : t->bytes()) ASSERT_EQ(b, 0xff) << what << ": an output was written";
    }
  }
};

}  // namespace

TEST(Validation, CrossEntropyBadInputs) {
  { Fixture f; f.out.loss = nullptr; f.expect(FCE_STATUS_INVALID_ARGUMENT, "NULL loss"); }
  { Fixture f; EXPECT_EQ(fce_cross_entropy_fwd(nullptr, nullptr, f.logits.dl(), f.targets.dl(), &f.o, &f.out, nullptr, 0),
                          FCE_STATUS_INVALID_ARGUMENT); }
  { Fixture f; EXPECT_EQ(fce_cross_entropy_fwd(f.h, nullptr, nullptr, f.targets.dl(), &f.o, &f.out, nullptr, 0),
                          FCE_STATUS_INVALID_ARGUMENT); }
  { Fixture f; f.logits.dl()->shape[1] = 0; f.expect(FCE_STATUS_SHAPE_MISMATCH, "V = 0"); }
  { Fixture f; f.logits.dl()->shape[0] = -3; f.expect(FCE_STATUS_SHAPE_MISMATCH, "N < 0"); }
  { Fixture f; f.targets.dl()->shape[0] = 3; f.expect(FCE_STATUS_SHAPE_MISMATCH, "targets length"); }
  { Fixture f; f.logits.dl()->ndim = 3; f.expect(FCE_STATUS_SHAPE_MISMATCH, "3-D logits"); }
  { Fixture f; f.logits.dl()->dtype = {kDLInt, 32, 1}; f.expect(FCE_STATUS_UNSUPPORTED_DTYPE, "int logits"); }
  { Fixture f; f.logits.dl()->dtype = {kDLFloat, 64, 1}; f.expect(FCE_STATUS_UNSUPPORTED_DTYPE, "fp64 logits"); }
  { Fixture f; f.logits.dl()->dtype.lanes = 2; f.expect(FCE_STATUS_UNSUPPORTED_DTYPE, "lanes"); }
  { Fixture f; f.targets.dl()->dtype = {kDLFloat, 32, 1}; f.expect(FCE_STATUS_UNSUPPORTED_DTYPE, "float targets"); }
  { Fixture f; f.dl.dl()->dtype = {kDLFloat, 32, 1}; f.expect(FCE_STATUS_UNSUPPORTED_DTYPE, "dlogits dtype"); }
  { Fixture f; f.logits.dl()->strides[1] = 2; f.expect(FCE_STATUS_UNSUPPORTED_LAYOUT, "column stride"); }
  { Fixture f; f.logits.dl()->strides[0] = 5; f.expect(FCE_STATUS_UNSUPPORTED_LAYOUT, "row stride < V"); }
  { Fixture f; f.logits.dl()->device.device_type = kDLCUDA; f.logits.dl()->device.device_type = target().cuda() ? kDLCPU : kDLCUDA; f.expect(FCE_STATUS_DEVICE_MISMATCH, "device"); }
  { Fixture f; f.logits.dl()->data = nullptr; f.expect(FCE_STATUS_INVALID_ARGUMENT, "NULL data"); }
  { Fixture f; f.logits.dl()->byte_offset = 1; f.expect(FCE_STATUS_UNSUPPORTED_LAYOUT, "misaligned element"); }
  { Fixture f; f.logits.dl()->shape[0] = int64_t(1) << 62; f.targets.dl()->shape[0] = int64_t(1) << 62; f.expect(FCE_STATUS_OVERFLOW, "size overflow"); }
  { Fixture f; f.o.reduction = 7; f.expect(FCE_STATUS_INVALID_ARGUMENT, "reduction"); }
  { Fixture f; f.o.label_smoothing = 1.5f; f.expect(FCE_STATUS_INVALID_ARGUMENT, "label smoothing"); }
  { Fixture f; f.o.logit_scale = 0.f; f.expect(FCE_STATUS_INVALID_ARGUMENT, "scale"); }
  { Fixture f; f.o.softcap = -1.f; f.expect(FCE_STATUS_INVALID_ARGUMENT, "softcap"); }
  { Fixture f; f.o.z_loss_scale = NAN; f.expect(FCE_STATUS_INVALID_ARGUMENT, "z-loss"); }
  { Fixture f; f.o.struct_size = 4; f.expect(FCE_STATUS_INVALID_ARGUMENT, "struct_size"); }
  { Fixture f; f.out.struct_size = 0; f.expect(FCE_STATUS_INVALID_ARGUMENT, "outputs struct_size"); }
  { Fixture f; f.out.lse = f.loss.dl(); f.expect(FCE_STATUS_SHAPE_MISMATCH, "lse shape"); }
  { Fixture f; f.o.reduction = FCE_REDUCTION_NONE; f.expect(FCE_STATUS_SHAPE_MISMATCH, "scalar loss with NONE"); }
  { Fixture f; Tensor w(DT::F32, {9}); f.o.class_weights = w.dl(); f.expect(FCE_STATUS_SHAPE_MISMATCH, "weights length"); }
  { Fixture f; Tensor g(DT::F32, {4}); f.out.grad_loss = g.dl(); f.expect(FCE_STATUS_SHAPE_MISMATCH, "per-row grad with MEAN"); }
  // Overlaps: lse inside dlogits; dlogits over logits shifted by one row.
  { Fixture f; DLTensor l = *f.lse.dl(); l.data = f.dl.dl()->data; f.out.lse = &l; f.expect(FCE_STATUS_ALIASING, "lse in dlogits"); }
  { Fixture f; DLTensor d = *f.logits.dl(); d.shape = f.dl.dl()->shape; d.byte_offset = 2; f.out.dlogits = &d; f.expect(FCE_STATUS_ALIASING, "partial overlap with logits"); }
  {  // in-place dlogits is fine, but not when the targets share those very bytes
    Handle h;
    Tensor x(DT::F32, {2, 4});
    fill_logits(x, 1, false);
    DLTensor t = *x.dl();
    int64_t ts[1] = {4};
    t.ndim = 1;
    t.shape = ts;
    t.strides = nullptr;
    t.dtype = {kDLInt, 64, 1};  // 4 x int64 = the logits' 32 bytes
    Tensor lse(DT::F32, {2});
    EXPECT_EQ(fce_cross_entropy_bwd(h, test_stream(), x.dl(), &t, lse.dl(), nullptr, nullptr, x.dl(), nullptr, 0),
              FCE_STATUS_SHAPE_MISMATCH) << "4 targets for 2 rows";
    ts[0] = 2;
    t.dtype = {kDLInt, 32, 1};
    DLTensor x2 = *x.dl();
    int64_t xs[2] = {2, 1};
    x2.shape = xs;  // 2 x 1 fp32 logits = 8 bytes = the targets' 2 x int32
    EXPECT_EQ(fce_cross_entropy_bwd(h, test_stream(), &x2, &t, lse.dl(), nullptr, nullptr, &x2, nullptr, 0),
              FCE_STATUS_ALIASING);
  }
}

TEST(Validation, WorkspaceTooSmallAndQueries) {
  Handle h;
  Tensor hid(DT::F32, {8, 16}), w(DT::F32, {50, 16}), tg(DT::I32, {8}), loss(DT::F32, {}), dh(DT::F32, {8, 16});
  for (int i = 0; i < 8; ++i) tg.set_int(i, i);
  tg.upload();
  loss.poison(); loss.upload(); dh.poison(); dh.upload();
  fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
  out.loss = loss.dl(); out.dhidden = dh.dl();
  size_t need = 0;
  FCE_OK(fce_linear_cross_entropy_fwd_workspace_size(h, hid.dl(), w.dl(), nullptr, tg.dl(), nullptr, &out, &need));
  EXPECT_GT(need, 0u);
  char small[16];
  EXPECT_EQ(fce_linear_cross_entropy_fwd(h, test_stream(), hid.dl(), w.dl(), nullptr, tg.dl(), nullptr, &out, small, 16),
            FCE_STATUS_WORKSPACE_TOO_SMALL);
  loss.download();
  for (uint8_t b : loss.bytes()) ASSERT_EQ(b, 0xff);
  EXPECT_EQ(fce_linear_cross_entropy_fwd_workspace_size(h, hid.dl(), w.dl(), nullptr, tg.dl(), nullptr, &out, nullptr),
            FCE_STATUS_INVALID_ARGUMENT);
  out.dbias = dh.dl();
  EXPECT_EQ(fce_linear_cross_entropy_fwd(h, test_stream(), hid.dl(), w.dl(), nullptr, tg.dl(), nullptr, &out, nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT) << "dbias without bias";
}

TEST(Validation, OtherOps) {
  Handle h;
  Tensor x(DT::F16, {3, 8}), lse(DT::F32, {3}), p(DT::BF16, {3, 8});
  fill_logits(x, 1, false);
  fce_softmax_options_t so = FCE_SOFTMAX_OPTIONS_INIT;
  so.temperature = -1.f;
  Tensor pf(DT::F32, {3, 8});
  EXPECT_EQ(fce_temp_softmax(h, test_stream(), x.dl(), &so, pf.dl(), nullptr, nullptr, 0), FCE_STATUS_INVALID_ARGUMENT);
  so.temperature = 1.f;
  EXPECT_EQ(fce_temp_softmax(h, test_stream(), x.dl(), &so, p.dl(), nullptr, nullptr, 0), FCE_STATUS_UNSUPPORTED_DTYPE)
      << "bf16 probabilities for fp16 logits";
  EXPECT_EQ(fce_temp_softmax(h, test_stream(), x.dl(), &so, nullptr, nullptr, nullptr, 0), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(fce_temp_softmax(h, test_stream(), x.dl(), &so, pf.dl(), pf.dl(), nullptr, 0), FCE_STATUS_ALIASING);
  {  // logprobs may be in place only as the one output (probs elsewhere): the header's rule
    Tensor x2(DT::F32, {3, 8});
    DLTensor lp = *x2.dl();
    EXPECT_EQ(fce_temp_softmax(h, test_stream(), x2.dl(), &so, pf.dl(), &lp, nullptr, 0), FCE_STATUS_ALIASING);
    EXPECT_EQ(fce_temp_softmax(h, test_stream(), x2.dl(), &so, nullptr, &lp, nullptr, 0), FCE_STATUS_SUCCESS);
  }
  {  // probs and logprobs both in place over fp16 logits: two outputs over the same bytes
    Tensor x2(DT::F16, {3, 8});
    DLTensor a = *x2.dl(), b = *x2.dl();
    EXPECT_EQ(fce_temp_softmax(h, test_stream(), x2.dl(), &so, &a, &b, nullptr, 0), FCE_STATUS_ALIASING);
  }
  fce_lse_options_t lo = FCE_LSE_OPTIONS_INIT;
  lo.scale = INFINITY;
  EXPECT_EQ(fce_logsumexp(h, test_stream(), x.dl(), &lo, lse.dl(), nullptr, 0), FCE_STATUS_INVALID_ARGUMENT);
  Tensor lse2(DT::F32, {2});
  EXPECT_EQ(fce_logsumexp(h, test_stream(), x.dl(), nullptr, lse2.dl(), nullptr, 0), FCE_STATUS_SHAPE_MISMATCH);
  fce_kd_teacher_t t = FCE_KD_TEACHER_INIT;
  Tensor loss(DT::F32, {});
  fce_kd_outputs_t ko = FCE_KD_OUTPUTS_INIT;
  ko.loss = loss.dl();
  EXPECT_EQ(fce_kd_loss(h, test_stream(), x.dl(), &t, nullptr, nullptr, &ko, nullptr, 0), FCE_STATUS_INVALID_ARGUMENT)
      << "no teacher";
  Tensor tl(DT::F32, {3, 9});
  t.logits = tl.dl();
  EXPECT_EQ(fce_kd_loss(h, test_stream(), x.dl(), &t, nullptr, nullptr, &ko, nullptr, 0), FCE_STATUS_SHAPE_MISMATCH);
  Tensor tl2(DT::F32, {3, 8});
  t.logits = tl2.dl();
  fce_kd_options_t kopt = FCE_KD_OPTIONS_INIT;
  kopt.beta = 2.f;
  EXPECT_EQ(fce_kd_loss(h, test_stream(), x.dl(), &t, nullptr, &kopt, &ko, nullptr, 0), FCE_STATUS_INVALID_ARGUMENT);
  kopt = FCE_KD_OPTIONS_INIT;
  kopt.temperature = 0.f;
  EXPECT_EQ(fce_kd_loss(h, test_stream(), x.dl(), &t, nullptr, &kopt, &ko, nullptr, 0), FCE_STATUS_INVALID_ARGUMENT);
}

TEST(Validation, HandlesStatusesAndVersion) {
  fce_handle_t h = nullptr;
  EXPECT_EQ(fce_handle_create(kDLCPU, 0, nullptr), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(fce_handle_create(kDLOpenCL, 0, &h), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(h, nullptr);
  if (!target().cuda()) {
    const fce_status_t s = fce_handle_create(kDLCUDA, 0, &h);
    EXPECT_TRUE(s == FCE_STATUS_NO_DEVICE || s == FCE_STATUS_SUCCESS) << fce_status_string(s);
    if (s == FCE_STATUS_NO_DEVICE) {
      std::string msg = fce_last_error_message();
      for (char& ch : msg) ch = char(std::tolower(static_cast<unsigned char>(ch)));
      EXPECT_NE(msg.find("cuda"), std::string::npos) << "the message names CUDA";
    }
    fce_handle_destroy(h);
    h = nullptr;
  }
  EXPECT_EQ(fce_handle_destroy(nullptr), FCE_STATUS_SUCCESS);
  FCE_OK(fce_handle_create(kDLCPU, 0, &h));
  int32_t dt = -1;
  FCE_OK(fce_handle_get_device(h, &dt, nullptr));
  EXPECT_EQ(dt, kDLCPU);
  EXPECT_STREQ(fce_last_error_message(), "");
  fce_handle_destroy(h);
  for (int s = 0; s <= 16; ++s) EXPECT_STRNE(fce_status_string(fce_status_t(s)), "unknown status");
  EXPECT_STREQ(fce_status_string(fce_status_t(999)), "unknown status");
  EXPECT_EQ(fce_version_number(), unsigned(FCE_VERSION_NUMBER));
  EXPECT_EQ(fce_abi_version(), unsigned(FCE_ABI_VERSION));
  char v[32];
  snprintf(v, sizeof v, "%d.%d.%d", FCE_VERSION_MAJOR, FCE_VERSION_MINOR, FCE_VERSION_PATCH);
  EXPECT_STREQ(fce_version_string(), v);
}

// Issue 47, item 8: fce_cross_entropy_record_fields takes no tensors, but its options are the other CE calls'
// and are validated as theirs are (read_ce_options' checks): an option out of its domain is INVALID_ARGUMENT
// with the same message, and `fields` is left as it was.
TEST(Validation, RecordFieldsValidatesTheOptions) {
  const auto bad = [](const char* what, const std::function<void(fce_ce_options_t&)>& set, const char* names) {
    fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
    set(o);
    int64_t fields = -7;
    EXPECT_EQ(fce_cross_entropy_record_fields(&o, &fields), FCE_STATUS_INVALID_ARGUMENT) << what;
    EXPECT_NE(std::string(fce_last_error_message()).find(names), std::string::npos)
        << what << ": " << fce_last_error_message();
    EXPECT_EQ(fields, -7) << what << ": fields written";
  };
  bad("logit_scale -1", [](fce_ce_options_t& o) { o.logit_scale = -1.f; }, "options->logit_scale");
  bad("logit_scale NaN", [](fce_ce_options_t& o) { o.logit_scale = NAN; }, "options->logit_scale");
  bad("reduction 9", [](fce_ce_options_t& o) { o.reduction = 9; }, "options->reduction");
  bad("label_smoothing 2", [](fce_ce_options_t& o) { o.label_smoothing = 2.f; }, "options->label_smoothing");
  bad("z_loss_scale -1", [](fce_ce_options_t& o) { o.z_loss_scale = -1.f; }, "options->z_loss_scale");
  bad("softcap inf", [](fce_ce_options_t& o) { o.softcap = INFINITY; }, "options->softcap");
  bad("vocab_start past vocab_total", [](fce_ce_options_t& o) { o.vocab_start = 9; o.vocab_total = 8; },
      "options->vocab_start");
  bad("vocab_total negative", [](fce_ce_options_t& o) { o.vocab_total = -1; }, "options->vocab_total");
  bad("struct_size 4", [](fce_ce_options_t& o) { o.struct_size = 4; }, "options->struct_size");
  // The same options pass the other entry points' check identically: one validator.
  {
    Fixture f;
    f.o.logit_scale = -1.f;
    f.expect(FCE_STATUS_INVALID_ARGUMENT, "fwd logit_scale -1");
    const std::string fwd = fce_last_error_message();
    int64_t fields = 0;
    EXPECT_EQ(fce_cross_entropy_record_fields(&f.o, &fields), FCE_STATUS_INVALID_ARGUMENT);
    const std::string rec = fce_last_error_message();
    EXPECT_EQ(fwd.substr(fwd.find(": ")), rec.substr(rec.find(": "))) << "the same check, the same words";
  }
  // Valid options (a shard's, the defaults, NULL) still give the full record width.
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.vocab_start = 3; o.vocab_total = 10; o.label_smoothing = 0.1f; o.logit_scale = 2.f; o.reduction = FCE_REDUCTION_SUM;
  int64_t fields = 0;
  FCE_OK(fce_cross_entropy_record_fields(&o, &fields));
  EXPECT_EQ(fields, FCE_CE_RECORD_FIELDS_ALL);
  fields = 0;
  FCE_OK(fce_cross_entropy_record_fields(nullptr, &fields));
  EXPECT_EQ(fields, FCE_CE_RECORD_FIELDS_ALL);
  EXPECT_EQ(fce_cross_entropy_record_fields(&o, nullptr), FCE_STATUS_INVALID_ARGUMENT);
}

// Issue 47, item 9: a refused dtype is named as frameworks name it (float64, uint8, bool, complex64, ...), in the
// DLPack codes only when it has no name.
TEST(Validation, DtypeMessagesNameTheDtype) {
  const auto named = [](const char* what, DLDataType dt, bool targets, const char* want) {
    Fixture f;
    (targets ? f.targets : f.logits).dl()->dtype = dt;
    f.expect(FCE_STATUS_UNSUPPORTED_DTYPE, what);
    const std::string m = fce_last_error_message();
    EXPECT_NE(m.find(std::string(targets ? "targets has dtype " : "logits has dtype ") + want), std::string::npos)
        << what << ": " << m;
  };
  named("float64 logits", {kDLFloat, 64, 1}, false, "float64;");
  named("int32 logits", {kDLInt, 32, 1}, false, "int32;");
  named("int64 logits", {kDLInt, 64, 1}, false, "int64;");
  named("int8 logits", {kDLInt, 8, 1}, false, "int8;");
  named("uint8 targets", {kDLUInt, 8, 1}, true, "uint8;");
  named("float32 targets", {kDLFloat, 32, 1}, true, "float32;");
  named("bfloat16 targets", {kDLBfloat, 16, 1}, true, "bfloat16;");
  named("float16 targets", {kDLFloat, 16, 1}, true, "float16;");
  named("bool logits", {6, 8, 1}, false, "bool;");               // kDLBool (DLPack >= 0.8)
  named("complex64 logits", {kDLComplex, 64, 1}, false, "complex64;");
  named("complex128 logits", {kDLComplex, 128, 1}, false, "complex128;");
  named("float8_e4m3fn logits", {10, 8, 1}, false, "float8_e4m3fn;");  // kDLFloat8_e4m3fn (DLPack 1.1)
  named("float8_e5m2 logits", {12, 8, 1}, false, "float8_e5m2;");
  named("4 lanes of float32", {kDLFloat, 32, 4}, false, "float32x4;");
  named("no name", {7, 3, 2}, false, "(code 7, bits 3, lanes 2);");
  named("float of 24 bits", {kDLFloat, 24, 1}, false, "(code 2, bits 24, lanes 1);");
  named("no lanes", {kDLFloat, 32, 0}, false, "(code 2, bits 32, lanes 0);");
  {
    Fixture f;
    f.logits.dl()->dtype = {kDLFloat, 64, 1};
    f.expect(FCE_STATUS_UNSUPPORTED_DTYPE, "float64");
    EXPECT_STREQ(fce_last_error_message(),
                 "fce_cross_entropy_fwd: logits has dtype float64; expected float32, bfloat16 or float16");
  }
}
